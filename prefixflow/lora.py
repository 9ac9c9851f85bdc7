"""Per-row LoRA adapters: the job's adapter folder, and which adapter a row asks for.

ray.data.llm's convention: a row whose `model` column names something other than the job's
model names a LoRA adapter, a subfolder of `dynamic_lora_loading_path` (our `lora.path`), in
PEFT's layout (adapter_config.json + adapter_model.safetensors). The base model serves rows
whose `model` is empty, null or the job's model.

Rows of different adapters must never share KV (the same tokens give other keys and values
under another adapter) and rows of one adapter should: the planner keys its prefix tree by
(adapter, tokens), by seeding each row's chain of block hashes with its adapter's key
(`adapter_key`, pipeline/block_hash.py). Torch-free: read where the job starts and on every
tokenize worker.

Only safetensors weights are accepted: PEFT's older adapter_model.bin is a pickle, and nothing
a job or its dataset names may execute code. An adapter is named by its folder's name alone
(no path), so a row cannot point the engine at any other file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixflow.errors import invalid
from prefixflow.storage import is_local, local_path

ADAPTER_COLUMN = "model"  # ray.data.llm's: the row's model, an adapter's name or the base model
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# vLLM's max_lora_rank must be one of these (vllm/config/lora.py MaxLoRARanks).
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter: its name (the row's `model` value), folder and rank (PEFT's `r`)."""

    name: str
    path: str
    rank: int


@dataclass(frozen=True)
class LoraConfig:
    """Per-row LoRA adapters (engine.backend vllm): ray.data.llm's dynamic_lora_loading_path and
    its LoRA engine arguments. The job spec's `lora` section is generated from this class.

    path: a folder with one subfolder per adapter (PEFT's layout, safetensors weights); a row's
        `model` column names the subfolder. Local or on a file system every node mounts.
    max_loras: adapters an engine holds at once (vLLM's max_loras); None: all of them, up to 8.
    max_lora_rank: vLLM's max_lora_rank; None: the smallest that holds every adapter's rank.
    Building it reads nothing; `adapters()` reads the folder where the job starts.
    """

    path: str
    max_loras: int | None = None
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise invalid("LoraConfig", "path", self.path, "give the folder holding one subfolder per adapter")
        if self.max_loras is not None and (
            not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 1
        ):
            raise invalid("LoraConfig", "max_loras", self.max_loras, "use null or an integer of at least 1")
        if self.max_lora_rank is not None and self.max_lora_rank not in VLLM_MAX_RANKS:
            ranks = ", ".join(map(str, VLLM_MAX_RANKS))
            raise invalid("LoraConfig", "max_lora_rank", self.max_lora_rank, f"use null or one of {ranks} (vLLM's)")

    def adapters(self) -> "LoraAdapters":
        found = find_adapters(self.path)
        rank = vllm_max_rank(found.values())
        if self.max_lora_rank is not None:
            too_big = [a for a in found.values() if a.rank > self.max_lora_rank]
            if too_big:
                raise ValueError(
                    f"LoRA adapter {too_big[0].name!r} has rank {too_big[0].rank}, above lora.max_lora_rank "
                    f"{self.max_lora_rank}: raise it or leave it unset"
                )
            rank = self.max_lora_rank
        slots = self.max_loras or min(len(found), 8)
        return LoraAdapters(tuple(found.values()), slots, rank)


@dataclass(frozen=True)
class LoraAdapters:
    """What a job's engines serve: its adapters (sorted by name), how many at once, the rank."""

    adapters: tuple[Adapter, ...]
    max_loras: int
    max_lora_rank: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)

    def vllm_args(self, cpu: bool = False) -> dict[str, Any]:
        """vLLM's LoRA engine arguments. Every adapter stays in CPU memory once loaded
        (max_cpu_loras), so an adapter leaving the engine's slots is not read from disk again.

        cpu: vLLM's CPU build (0.32) picks each token's adapter weights by indexing the slots
        with the token's slot number, and a base-model token's number is -1: Python's last
        slot. A base row batched with adapter rows then runs with the last slot's adapter
        (seen here: the tiny checkpoint's base rows gave the merged model's outputs of an
        adapter; upstream: vllm-project/vllm pull request 48421, open). On the CPU the engine
        therefore gets one slot more than adapters exist; vLLM fills the first free slot and
        holds each adapter in at most one, so the last slot is never filled and stays zero, and
        base tokens get nothing added, as on a GPU, whose kernels skip -1."""
        slots = self.max_loras
        if cpu:
            slots = len(self.adapters) + 1
        return {
            "enable_lora": True,
            "max_loras": slots,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": max(slots, len(self.adapters)),
        }


def find_adapters(folder: str) -> dict[str, Adapter]:
    """Every adapter under `folder` (one subfolder each, in PEFT's layout), by name.
    ValueError naming the folder or the subfolder when one is not an adapter we can load."""
    if not is_local(folder):
        raise ValueError(
            f"lora.path {folder!r}: adapters are read from a local or shared folder (one every "
            "node mounts); copy them there from object storage"
        )
    root = Path(local_path(folder))
    if not root.is_dir():
        raise ValueError(f"lora.path {folder!r} is not a folder: give the folder holding one subfolder per adapter")
    adapters = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        adapters[sub.name] = _adapter(sub)
    if not adapters:
        raise ValueError(f"lora.path {folder!r} holds no adapter: give one subfolder per adapter (PEFT's layout)")
    return adapters


def _adapter(folder: Path) -> Adapter:
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(
            f"LoRA adapter {folder}: no {CONFIG_FILE} (PEFT's layout: save it with peft's save_pretrained)"
        )
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(
            f"LoRA adapter {folder}: no {WEIGHTS_FILE}; pickled weights (adapter_model.bin) are not loaded, "
            "since loading them can run code: save the adapter with safe_serialization=True"
        )
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_FILE} is not a LoRA adapter's (peft_type must be LORA)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_FILE} has r={rank!r}; a LoRA rank is a positive integer")
    return Adapter(folder.name, str(folder), rank)


def vllm_max_rank(adapters: Collection[Adapter]) -> int:
    """The smallest max_lora_rank vLLM accepts that holds every adapter's rank."""
    need = max((a.rank for a in adapters), default=1)
    for rank in VLLM_MAX_RANKS:
        if rank >= need:
            return rank
    raise ValueError(f"a LoRA adapter has rank {need}: vLLM serves ranks up to {VLLM_MAX_RANKS[-1]}")


def row_adapter(value: Any, base_model: str, known: Collection[str]) -> str | None:
    """The adapter a row's `model` value names (None: the base model). ValueError when it names
    none of `known`."""
    if value is None or value == "" or value == base_model:
        return None
    if not isinstance(value, str):
        raise ValueError(f"the row's model is {value!r}: give an adapter's name (a string) or leave it empty")
    if value not in known:
        names = ", ".join(sorted(known)[:10]) or "none"
        raise ValueError(
            f"the row's model {value!r} is neither the job's model nor a LoRA adapter under lora.path "
            f"(adapters: {names})"
        )
    return value


def adapter_key(name: str | None) -> int:
    """A 64-bit key of an adapter for the block-hash chains (0: the base model)."""
    if name is None:
        return 0
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") | 1
