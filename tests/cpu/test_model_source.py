"""What `model:` names -> a local folder (prefixflow/model_source.py), on the tiny checkpoint: a hub
id in a temporary Hugging Face cache loads; a missing hub id, a broken GGUF file, a folder
without weights and an unknown path each give one error naming the model and what to do; an
s3:// folder is copied once; dtype "auto" picks the checkpoint's dtype on a GPU only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from prefixflow.engine.models.loader import load_model, load_tokenizer, torch_dtype
from prefixflow.model_source import ModelError, model_kind, normalize_model, resolve_model

REPO = "prefixflow-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def own_caches(tmp_path, monkeypatch):
    """Each test gets empty prefixflow and Hugging Face caches and no hub access."""
    monkeypatch.setenv("PREFIXFLOW_CACHE", str(tmp_path / "pf-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def add_to_hf_cache(cache: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """Lay `folder` out as huggingface_hub caches a download: blobs, a snapshot of links to
    them, and refs/main naming the snapshot's commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        blob = root / "blobs" / f"{commit[:8]}-blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_in_the_local_cache_loads(tiny_model, tmp_path):
    from huggingface_hub import scan_cache_dir

    snapshot = add_to_hf_cache(tmp_path / "hf-hub", REPO, tiny_model)
    assert [r.repo_id for r in scan_cache_dir(tmp_path / "hf-hub").repos] == [REPO]
    assert model_kind(REPO) == "hub" and normalize_model(REPO) == REPO
    assert resolve_model(REPO) == snapshot
    model = load_model(REPO, device="cpu")
    assert model.args.num_layers == 2
    assert load_tokenizer(REPO).encode("the model reads")


def test_missing_hub_id_is_one_clear_error():
    with pytest.raises(ModelError) as err:
        resolve_model("prefixflow-test/not-downloaded")
    msg = str(err.value)
    assert "'prefixflow-test/not-downloaded'" in msg and "hf download" in msg
    assert isinstance(err.value, ValueError)


def test_broken_gguf_is_one_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelError, match=r"broken\.gguf.*is not a GGUF file"):
        resolve_model(str(bad))
    assert not any((tmp_path / "pf-cache" / "models").iterdir())  # nothing half-written kept
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_folder_without_weights_or_config(tiny_model, tmp_path):
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_model, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no_weights.*no \*\.safetensors weights"):
        resolve_model(str(no_weights))
    (no_weights / "config.json").unlink()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(no_weights))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))


def test_forms_and_normalized_names(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_kind("smollm2-135m-instruct") == "short"
    assert model_kind("s3://bucket/models/x") == "s3"
    assert model_kind("x/model.gguf") == "gguf"
    assert model_kind(str(tiny_model)) == "folder" and model_kind("./nowhere") == "folder"
    assert normalize_model("./m") == str(tmp_path / "m")
    assert normalize_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert resolve_model(str(tiny_model)) == tiny_model


def test_s3_folder_is_copied_once(tiny_model, s3_server, caplog):
    from support.s3 import s3_bucket

    storage = s3_bucket(s3_server, "models")
    fs = storage.filesystem("s3://models")
    fs.put(str(tiny_model) + "/", "models/tiny/", recursive=True)
    with caplog.at_level("INFO", logger="prefixflow.model_source"):
        local = resolve_model("s3://models/tiny", storage)
        assert (local / "config.json").is_file() and model_kind(str(local)) == "folder"
        assert resolve_model("s3://models/tiny/", storage) == local  # the node's copy, one listing
    # the copy is reported through the module's logger (not print), once
    assert [r.getMessage() for r in caplog.records] == [f"copying s3://models/tiny to {local} (once per node)"]
    # Weights replaced on S3 under the same path: copied again, not served from the old copy
    # (issue 27: a resume must not mix two models behind one path).
    config = json.loads((tiny_model / "config.json").read_text())
    fs.pipe_file("models/tiny/config.json", json.dumps({**config, "rms_norm_eps": 1e-5}).encode())
    fresh = resolve_model("s3://models/tiny", storage)
    assert fresh != local and json.loads((fresh / "config.json").read_text())["rms_norm_eps"] == 1e-5
    with pytest.raises(ModelError, match="'s3://models/absent' could not be copied"):
        resolve_model("s3://models/absent", storage)


def test_hub_id_fingerprint_changes_with_its_revision(tiny_model, tmp_path):
    """A hub id whose cached snapshot moves to a new revision with other weights: resolving
    it gives the new snapshot, and its fingerprint differs (a resume refuses to mix them)."""
    from prefixflow.model_source import model_fingerprint

    add_to_hf_cache(tmp_path / "hf-hub", REPO, tiny_model)
    first = model_fingerprint(resolve_model(REPO))
    retrained = tmp_path / "retrained"
    shutil.copytree(tiny_model, retrained)
    data = bytearray((retrained / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (retrained / "model.safetensors").write_bytes(bytes(data))
    snapshot = add_to_hf_cache(tmp_path / "hf-hub", REPO, retrained, commit="f" * 40)
    assert resolve_model(REPO) == snapshot
    second = model_fingerprint(resolve_model(REPO))
    assert second["model.safetensors"] != first["model.safetensors"]
    assert second["config.json"] == first["config.json"]


def test_model_fingerprint_follows_content_not_path(tiny_model, tmp_path):
    """The fingerprint a resume compares: same files, same digest; weights rewritten in place
    (even to the same size) change it, and the hashes are cached per machine."""
    from prefixflow.model_source import model_fingerprint

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    first = model_fingerprint(folder)
    assert {"config.json", "model.safetensors"} <= set(first) and model_fingerprint(folder) == first
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    weights.write_bytes(bytes(data))
    changed = model_fingerprint(folder)
    assert changed["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in changed.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }


def _rewrite_in_place(path: Path) -> None:
    """Other bytes of the same size into the same inode, the mtime set back as `touch -r` does."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:  # the same inode: no new file, no rename
        f.write(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("racy_seconds", [None, 0.0])
def test_weights_rewritten_in_place_with_their_mtime_restored_get_a_new_digest(
    tiny_model, tmp_path, monkeypatch, racy_seconds
):
    """Issue 43: same path, inode, size and mtime, other bytes: the fingerprint follows the bytes
    (the cache's key has the ctime, which only the kernel sets). racy_seconds 0 remembers even a
    file changed a moment ago, as every entry is once its file is a few seconds old."""
    from prefixflow import digest
    from prefixflow.model_source import model_fingerprint

    if racy_seconds is not None:
        monkeypatch.setattr(digest, "RACY_SECONDS", racy_seconds)
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    first = model_fingerprint(folder)
    assert model_fingerprint(folder) == first
    _rewrite_in_place(folder / "model.safetensors")
    second = model_fingerprint(folder)
    assert second["model.safetensors"] != first["model.safetensors"]
    assert second["model.safetensors"] == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_an_edited_cache_entry_is_not_trusted(tiny_model, tmp_path, monkeypatch):
    """Issue 43: a remembered digest edited by hand (here: another model's digest written into
    the entry) fails the entry's check, and the file is read again."""
    from prefixflow import digest
    from prefixflow.model_source import model_fingerprint

    monkeypatch.setattr(digest, "RACY_SECONDS", 0.0)  # remember the fresh copy
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    true = model_fingerprint(folder)["model.safetensors"]
    entries = [
        p for p in (tmp_path / "pf-cache" / "sha256").iterdir() if not p.name.startswith(".") and true in p.read_text()
    ]
    assert len(entries) == 1  # the weights' digest was remembered
    forged = hashlib.sha256(b"another model").hexdigest()
    entries[0].write_text(entries[0].read_text().replace(true, forged))
    assert model_fingerprint(folder)["model.safetensors"] == true


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoint_dtype_on_gpu(tiny_model, tmp_path):
    import json

    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_model, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert torch_dtype("auto", bf16, "cpu") == torch.float32
    assert torch_dtype("auto", bf16, "cuda") == torch.bfloat16  # decided without a GPU
    assert torch_dtype("float16", bf16, "cpu") == torch.float16
    assert load_model(bf16, device="cpu").model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype='int8'.*auto"):
        torch_dtype("int8", bf16, "cpu")


def test_generation_config_supplies_the_sampling_fields_not_set(tiny_model, tmp_path):
    import json

    from prefixflow.jobs import report
    from prefixflow.jobs.spec import parse_spec
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.requests import SamplingParams

    model = tmp_path / "with_defaults"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 33, "eos_token_id": 2})
    )
    api = ProcessorConfig(model=str(model), sampling={"temperature": 0.0})
    assert api.sampling == {"temperature": 0.0}  # kept as given
    params = api.sampling_params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.9, 33)
    assert api.sampling_params is params  # the model's file read once
    assert ProcessorConfig(model=str(model)).sampling_params.temperature == 0.7
    assert ProcessorConfig(model=str(model), sampling=SamplingParams()).sampling_params.top_p == 1.0

    spec = parse_spec(
        {
            "model": str(model),
            "input": {"path": "in.jsonl"},
            "output": {"path": "o"},
            "prompt": {"template": "{{ q }}"},
            "sampling": {"max_tokens": 8},
        }
    )
    assert spec.to_config().sampling_params == SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
    used = report.sampling_used(spec.to_config())  # what metrics.json records
    assert used["from_generation_config"] == {"temperature": 0.7, "top_p": 0.9}
    assert used["params"]["max_tokens"] == 8 and used["params"]["temperature"] == 0.7


def test_a_config_builds_without_its_model_and_reads_it_once(tiny_model, tmp_path):
    """Building a ProcessorConfig reads nothing (a driver that cannot reach the model builds
    and ships it); the model's generation_config.json is read on first use, and a config
    pickled after that (as Ray ships it to the actors) carries what was read."""
    import json
    import pickle

    from prefixflow.operators.config import ProcessorConfig

    missing = ProcessorConfig(
        model=str(tmp_path / "not-there"), sampling={"max_tokens": 4}, engine={"backend": "vllm"}, replicas=2
    )
    assert missing.sampling == {"max_tokens": 4} and missing.backend == "vllm"
    with pytest.raises(ModelError, match="does not exist"):
        missing.sampling_params
    assert ProcessorConfig(model="s3://no-such-bucket/model").engine_config.model == "s3://no-such-bucket/model"

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    config = ProcessorConfig(model=str(model))
    assert config.sampling_params.top_k == 7
    shipped = pickle.dumps(config)
    shutil.rmtree(model)  # gone: the shipped config does not read it again
    assert pickle.loads(shipped).sampling_params.top_k == 7


def test_a_damaged_safetensors_index_is_named(tiny_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(ModelError, match=r"model.safetensors.index.json' is not a safetensors index"):
        resolve_model(str(folder))
