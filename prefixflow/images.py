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
Each image is read once where the row is tokenized, checked to decode as an image (a bad one is
the row's error record, never the replica's failure), and travels with its row as bytes.

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
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from prefixflow.errors import invalid
from prefixflow.storage import StorageOptions, protocol, strip_scheme

DEFAULT_MAX_BYTES = 20 << 20
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
    timeout_s: seconds one URL fetch may take.
    """

    root: str | None = None
    allow_urls: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.root is not None and (not isinstance(self.root, str) or not self.root):
            raise invalid(
                "ImageConfig", "root", self.root, "give a folder every node reaches (a path or a URL), or null"
            )
        if self.root is not None and self.root.startswith(("http://", "https://")):
            raise invalid("ImageConfig", "root", self.root, "give a folder; http(s) images need images.allow_urls")
        if not isinstance(self.allow_urls, bool):
            raise invalid("ImageConfig", "allow_urls", self.allow_urls, "use true or false")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise invalid("ImageConfig", "max_bytes", self.max_bytes, "use a positive number of bytes")
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
        raise ValueError(f"the image has {len(data)} bytes, above images.max_bytes {config.max_bytes}")
    check_image(data)
    return data


def check_image(data: bytes) -> None:
    """ValueError unless `data` decodes as an image (Pillow reads its header and checks it)."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except UnidentifiedImageError:
        raise ValueError("the image cannot be read: its bytes are in no image format Pillow knows") from None
    except (OSError, SyntaxError, ValueError) as e:  # a known format, broken
        raise ValueError(f"the image cannot be read ({type(e).__name__}: {str(e)[:120]})") from None


def decode_image(data: bytes) -> Any:
    """A PIL image (RGB) of bytes that `load_image` accepted: what vLLM's processors take."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


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
    if protocol(config.root) not in (None, "file"):
        return _remote(source, config, storage)
    path = urllib.parse.unquote(source[len("file://") :]) if source.startswith("file://") else source
    root = os.path.realpath(strip_scheme(config.root))
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ValueError("the image's path is outside images.root: give a path under it")
    try:
        with open(full, "rb") as f:
            data = f.read(config.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"the image file cannot be read ({type(e).__name__}: {e.strerror})") from None
    return data


def _remote(source: str, config: ImageConfig, storage: StorageOptions) -> bytes:
    """An image under an images.root in object storage: `source` is relative to it, or a URL
    of the same scheme inside it (no `..` steps: object stores have no folders to leave)."""
    root = str(config.root).rstrip("/")
    url = source if "://" in source else f"{root}/{source.lstrip('/')}"
    if not url.startswith(root + "/") or ".." in url[len(root) :].split("/"):
        raise ValueError("the image's path is outside images.root: give a path under it")
    try:
        with storage.filesystem(url).open(url, "rb") as f:
            data: bytes = f.read(config.max_bytes + 1)
    except (OSError, ValueError) as e:  # FileNotFoundError, PermissionError, a client's error
        raise ValueError(f"the image cannot be read from storage ({type(e).__name__})") from None
    return data


def _fetch(url: str, config: ImageConfig) -> bytes:
    if not config.allow_urls:
        raise ValueError("the image is an http(s) URL, but the job does not fetch URLs: set images.allow_urls")
    request = urllib.request.Request(url, headers={"User-Agent": "prefixflow"})
    try:
        with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
            data: bytes = response.read(config.max_bytes + 1)
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise ValueError(f"the image URL could not be fetched ({type(e).__name__}: {str(e)[:120]})") from None
    return data
