"""Images in chat messages (engine.backend vllm with a vision-language model): where a row's
image may come from, its bytes, and the key the planner shares KV by.

A message's content part names an image as OpenAI does (`{"type": "image_url", "image_url":
{"url": ...}}`) or as Hugging Face chat templates do (`{"type": "image", "image": ...}`, or its
`url` / `path`). The source is one of:
  - a data URL (`data:image/png;base64,...`), always accepted;
  - a path under the job's `images.root` (relative to it, or absolute: a local folder, or a
    URL of object storage such as s3://bucket/pictures, read with the job's `storage`
    settings), else refused: a dataset must not make the job read the machine's files;
  - an http(s) URL, fetched only when the job sets `images.allow_urls`.
Each image is read once where the row is tokenized and decoded there once (a missing, broken,
oversized or refused one is the row's error record, never the replica's failure), and travels
with its row as bytes: each row holds its own copy while the job is planned, so a job of many
questions per large image holds them many times over in Ray's object store (a known cost).

The planner sees an image as part of the prompt by the hash of its bytes (`image_key`): the
placeholder token the chat template writes for it is replaced, for planning only, by that key,
so rows asking about the same image after the same system prompt share a prefix and rows with
other images share only what comes before. Pure Python: Pillow is imported where an image is
checked (it comes with vLLM).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from prefixflow.errors import invalid
from prefixflow.storage import StorageOptions, is_local, local_path, normal_path, protocol

DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_MAX_PIXELS = 40_000_000  # 8000 x 5000: past what vision encoders resize down from
# The formats decoded: Pillow's others include EPS, which it decodes by running Ghostscript.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
IMAGE_PART_TYPES = ("image_url", "image")
# Parts that are media vLLM may take but prefixflow has not built: refused by name.
UNBUILT_PART_TYPES = ("input_audio", "audio_url", "video_url", "video", "audio", "file")


@dataclass(frozen=True)
class ImageConfig:
    """Where a row's images may come from (the job spec's `images` section is generated from it).

    root: a folder every node reaches: local (mounted) or a URL (s3://bucket/pictures, read
        with the job's storage settings); image paths must lie under it (a relative path is
        taken from it). None: no image paths.
    allow_urls: fetch http(s) image URLs (False: such a row is an error record).
    max_bytes: the largest image accepted, encoded.
    max_pixels: the most pixels an image may have (width x height): its decoded size is what
        the engine holds, whatever the bytes (a few hundred bytes of PNG can claim gigapixels).
    timeout_s: seconds one URL fetch may take, all of it.
    The root is kept in storage.normal_path's form: a local one absolute, read where the job
    starts, so that every node reads the same folder.
    """

    root: str | None = None
    allow_urls: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.root is not None and (not isinstance(self.root, str) or not self.root):
            raise invalid(
                "ImageConfig", "root", self.root, "give a folder every node reaches (a path or a URL), or null"
            )
        if self.root is not None and protocol(self.root) in ("http", "https"):
            raise invalid("ImageConfig", "root", self.root, "give a folder; http(s) images need images.allow_urls")
        if self.root is not None:
            try:
                object.__setattr__(self, "root", normal_path(self.root))
            except ValueError as e:
                raise invalid("ImageConfig", "root", self.root, str(e)) from None
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid("ImageConfig", name, value, "use a positive integer")
        if not isinstance(self.allow_urls, bool):
            raise invalid("ImageConfig", "allow_urls", self.allow_urls, "use true or false")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise invalid("ImageConfig", "timeout_s", self.timeout_s, "use a positive number of seconds")


def part_image(part: dict[str, Any]) -> Any:
    """The image source a content part of type image_url or image names: a string, bytes, or a
    PIL image (ray.data.llm's examples put one in `image`); ValueError when it names none."""
    value = part.get(part["type"])
    if isinstance(value, dict):  # OpenAI's {"url": ...}, or a Hugging Face dataset's {"bytes", "path"}
        value = next((value[k] for k in ("url", "bytes", "path") if value.get(k)), None)
    if value is None:
        value = part.get("url", part.get("path"))
    if _is_pil(value):
        return value
    if not isinstance(value, (str, bytes)) or not value:
        raise ValueError(
            f'a content part of type {part["type"]} names no image: give {{"type": "image_url", '
            '"image_url": {"url": ...}} with a data URL, a path or an http(s) URL'
        )
    return value


def load_image(source: Any, config: ImageConfig, storage: StorageOptions | None = None) -> bytes:
    """The encoded bytes of the image `source` names (part_image), checked to decode; ValueError
    saying why not. storage: how to reach an images.root in object storage (the job's)."""
    if _is_pil(source):
        data = _png(source)
    elif isinstance(source, bytes):
        data = source
    elif source.startswith("data:"):
        data = _data_url(source)
    elif source.startswith(("http://", "https://")):
        data = _fetch(source, config)
    else:
        data = _under_root(source, config, storage or StorageOptions())
    if len(data) > config.max_bytes:
        raise ValueError(f"the image has more than images.max_bytes ({config.max_bytes}) bytes")
    check_image(data, config.max_pixels)
    return data


def check_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """ValueError unless `data` is an image of one of FORMATS, of at most `max_pixels`, that
    decodes whole: decoded here once, so that the engine never meets a broken image (a PNG can
    pass Pillow's verify() with garbage pixel data)."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size  # read from the header: a large one is never decoded
            if width * height <= max_pixels:
                image.load()
    except UnidentifiedImageError:
        raise ValueError(f"the image cannot be read: its bytes are in none of {', '.join(FORMATS)}") from None
    except Image.DecompressionBombError:  # past twice Pillow's own limit: refused before our check
        raise ValueError(f"the image has more pixels than images.max_pixels {max_pixels} allows") from None
    except Exception as e:  # noqa: BLE001 - a broken image raises what its decoder raises (OSError, SyntaxError, ...)
        raise ValueError(f"the image cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    if width * height > max_pixels:
        raise ValueError(f"the image has {width}x{height} pixels, above images.max_pixels {max_pixels}")


def decode_image(data: bytes) -> Any:
    """A PIL image (RGB) of bytes that `load_image` accepted: what vLLM's processors take.
    ValueError if it does not decode (never expected: check_image decoded it)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - what a decoder raises
        raise ValueError(f"the image cannot be decoded ({type(e).__name__})") from None


def image_key(data: bytes) -> int:
    """The planner's key of an image: 62 bits of the sha256 of its bytes (a non-negative int64
    that no vocabulary reaches, so it never equals a real token)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 2 | (1 << 40)


def _is_pil(value: Any) -> bool:
    """Whether `value` is a PIL image (without importing Pillow for rows that hold none)."""
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in type(value).__mro__)


def _png(image: Any) -> bytes:
    """A PIL image encoded losslessly (PNG), as it travels with its row."""
    import io

    out = io.BytesIO()
    try:
        image.save(out, format="PNG")
    except (OSError, ValueError) as e:
        raise ValueError(f"the image cannot be encoded ({type(e).__name__}: {str(e)[:120]})") from None
    return out.getvalue()


def _data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError("the image's data URL is not base64: give data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image's data URL holds invalid base64") from None


def _under_root(source: str, config: ImageConfig, storage: StorageOptions) -> bytes:
    """The bytes of the image at `source`, a path that must lie under images.root."""
    if config.root is None:
        raise ValueError("the image is a path, but the job sets no images.root: set it to the images' folder")
    if "://" in source and not source.startswith("file://") and protocol(source) != protocol(config.root):
        raise ValueError("the image's URL scheme is not accepted: give a data URL, a path under images.root or http(s)")
    if not is_local(config.root):
        return _remote(source, config, storage)
    path = urllib.parse.unquote(source[len("file://") :]) if source.startswith("file://") else source
    root = os.path.realpath(local_path(config.root))
    full = os.path.realpath(os.path.join(root, path))  # symbolic links followed, then checked
    if os.path.commonpath([root, full]) != root:
        raise ValueError("the image's path is outside images.root: give a path under it")
    if not os.path.isfile(full):  # a folder, a FIFO or a device would block or mislead open()
        raise ValueError("the image's path is not a file under images.root")
    try:
        with open(full, "rb") as f:
            data = f.read(config.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"the image file cannot be read ({type(e).__name__}: {e.strerror})") from None
    return data


def _remote(source: str, config: ImageConfig, storage: StorageOptions) -> bytes:
    """An image under an images.root in object storage: `source` is relative to it, or a URL
    of the same scheme inside it (no `..` or empty steps: object stores have no folders to leave)."""
    root = str(config.root).rstrip("/")
    if source.startswith("/"):
        raise ValueError("the image's path is outside images.root: give a path relative to it, or its URL")
    url = source if "://" in source else f"{root}/{source}"
    steps = url[len(root) + 1 :].split("/")
    if not url.startswith(root + "/") or any(step in ("", ".", "..") for step in steps):
        raise ValueError("the image's path is outside images.root: give a path under it")
    try:
        with storage.filesystem(url).open(url, "rb") as f:
            data: bytes = f.read(config.max_bytes + 1)
    except (OSError, ValueError) as e:  # FileNotFoundError, PermissionError, a client's error
        raise ValueError(f"the image cannot be read from storage ({type(e).__name__})") from None
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed only to http(s) URLs (urllib's default also follows ftp://)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a URL that is not http(s)", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, config: ImageConfig) -> bytes:
    """The image at an http(s) URL: at most max_bytes + 1 bytes, within timeout_s in all. Errors
    name the kind of failure and the HTTP status, not the server's words."""
    if not config.allow_urls:
        raise ValueError("the image is an http(s) URL, but the job does not fetch URLs: set images.allow_urls")
    deadline = time.monotonic() + config.timeout_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects())
    request = urllib.request.Request(url, headers={"User-Agent": "prefixflow"})
    chunks: list[bytes] = []
    try:
        with opener.open(request, timeout=config.timeout_s) as response:
            size = 0
            while size <= config.max_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fetch took more than images.timeout_s ({config.timeout_s} s)")
                chunk = response.read1(min(1 << 16, config.max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except urllib.error.HTTPError as e:
        raise ValueError(f"the image URL could not be fetched (HTTP status {e.code})") from None
    except TimeoutError as e:
        raise ValueError(f"the image URL could not be fetched ({e})") from None
    except (OSError, ValueError, http.client.HTTPException) as e:  # refused, reset, a malformed reply
        raise ValueError(f"the image URL could not be fetched ({type(e).__name__})") from None
    return b"".join(chunks)
