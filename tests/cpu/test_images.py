"""Images in chat messages (issue 40 item 4): read where rows are tokenized, planned by the hash
of their bytes, run on the vLLM backend with a tiny vision-language checkpoint (Idefics3, see
tests/support/vision.py) whose greedy answers equal transformers'.

The fast tests need no vLLM: image sources (data URLs, paths under images.root, http(s) URLs
only when allowed, from a server on loopback), content parts, the tokenize stage's columns and
the plan's keys. The slow one is a whole job on local Ray with its engine actor killed once a
part is committed: every row exactly once, bad images as error records, answers == transformers.
"""

from __future__ import annotations

import http.server
import io
import importlib.util
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from support.vision import data_url, image_message, make_tiny_vlm, png_bytes, transformers_answers

from prefixflow.bench.fault_bench import Driver, check_output, local_records, wait_until, worker_pid
from prefixflow.images import ImageConfig, image_key, load_image
from prefixflow.jobs.preflight import preflight
from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.results.write import read_output
from prefixflow.operators.stages.plan import plan_tokens
from prefixflow.operators.stages.tokenize import Tokenize
from prefixflow.operators.template import RowError, messages_from_value
from prefixflow.pipeline import HashedPrompts, build_plan
from prefixflow.pipeline.block_hash import block_hashes

SYSTEM = {"role": "system", "content": "You describe pictures in a few words."}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-idefics3")


# --- sources -------------------------------------------------------------------------------


def test_image_sources_data_url_path_under_root_and_refusals(tmp_path):
    png = png_bytes(1)
    assert load_image(data_url(png), ImageConfig()) == png
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    root = ImageConfig(root=str(tmp_path / "pics"))
    assert load_image("a.png", root) == png
    assert load_image(str(tmp_path / "pics" / "a.png"), root) == png
    assert load_image(f"file://{tmp_path}/pics/a.png", root) == png
    refusals = {
        "a.png": (ImageConfig(), "the job sets no images.root"),
        "../secret.png": (root, "outside images.root"),
        str(tmp_path / "secret.png"): (root, "outside images.root"),
        "missing.png": (root, "not a file under images.root"),
        "data:image/png;base64,aGVsbG8=": (root, "in none of PNG, JPEG, WEBP, GIF, BMP, TIFF"),
        "data:image/png,abc": (root, "is not base64"),
        "data:image/png;base64,@@@": (root, "invalid base64"),
        "s3://bucket/a.png": (root, "URL scheme is not accepted"),
        "http://127.0.0.1:9/a.png": (root, "does not fetch URLs: set images.allow_urls"),
        data_url(png): (ImageConfig(max_bytes=100), "more than images.max_bytes (100) bytes"),
        data_url(png[:60]): (root, "the image cannot be read"),
    }
    for source, (config, why) in refusals.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            load_image(source, config)


def _png_chunks(width: int, height: int, pixels: bytes) -> bytes:
    """A PNG of the given header and compressed pixel data, every CRC right."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_hostile_images_are_the_rows_errors(tmp_path, monkeypatch):
    """Found by an independent review: a few hundred bytes claiming gigapixels, pixel data that
    passes Pillow's verify() but does not decode, a format Pillow decodes by running Ghostscript,
    a FIFO and symbolic links under the root."""
    import zlib

    config = ImageConfig(root=str(tmp_path))
    bomb = _png_chunks(100_000, 100_000, zlib.compress(b"\0" * 100))
    garbage = _png_chunks(40, 40, b"not zlib data at all")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    for data, why in {
        bomb: "more pixels than images.max_pixels 40000000 allows",
        _png_chunks(9000, 9000, zlib.compress(b"\0" * 100)): "9000x9000 pixels, above images.max_pixels 40000000",
        garbage: "the image cannot be read (",
        eps: "in none of PNG, JPEG",
    }.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            load_image(data, config)
    with pytest.raises(ValueError, match="above images.max_pixels 100"):
        load_image(png_bytes(1), ImageConfig(max_pixels=100))
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "secret.png").write_bytes(png_bytes(1))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "link.png").symlink_to(tmp_path / "secret.png")
    (tmp_path / "pics" / "fifo.png").symlink_to(tmp_path / "fifo.png")
    with pytest.raises(ValueError, match="not a file under images.root"):
        load_image("fifo.png", config)
    for root in (str(tmp_path / "pics"), f"local://{tmp_path}/pics", f"file://{tmp_path}/pics"):
        with pytest.raises(ValueError, match="outside images.root"):
            load_image("link.png", ImageConfig(root=root))
    # a relative root is made absolute where the config is built (every node reads that folder)
    monkeypatch.chdir(tmp_path)
    assert ImageConfig(root="pics").root == str(tmp_path / "pics")


def test_images_under_a_root_in_object_storage(s3_server):
    """images.root on S3 (moto on loopback), read with the job's storage settings: relative
    paths and URLs inside the root; nothing outside it."""
    from support.s3 import s3_bucket

    storage = s3_bucket(s3_server, "pf-images")
    png = png_bytes(4)
    fs = storage.filesystem("s3://pf-images/pics/a.png")
    with fs.open("s3://pf-images/pics/a.png", "wb") as f:
        f.write(png)
    with fs.open("s3://pf-images/secret/b.png", "wb") as f:
        f.write(png)
    config = ImageConfig(root="s3://pf-images/pics")
    assert load_image("a.png", config, storage) == png
    assert load_image("s3://pf-images/pics/a.png", config, storage) == png
    for source, why in {
        "s3://pf-images/secret/b.png": "outside images.root",
        "../secret/b.png": "outside images.root",
        "s3://pf-images/pics2/a.png": "outside images.root",
        "missing.png": "cannot be read from storage (FileNotFoundError)",
        "gs://pf-images/pics/a.png": "URL scheme is not accepted",
    }.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            load_image(source, config, storage)


def test_image_urls_fetched_only_when_allowed(tmp_path):
    png = png_bytes(2)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/garbage":
                self.wfile.write(b"GARBAGE\r\n\r\n")
                return
            if self.path == "/ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/a.png")
                self.end_headers()
                return
            body = png if self.path in ("/a.png", "/slow") else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)) if self.path == "/slow" else ():  # a byte every 0.3 s
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.3)
            if self.path != "/slow":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    allowed = ImageConfig(allow_urls=True, timeout_s=1)
    try:
        assert load_image(f"{url}/a.png", allowed) == png
        for path, why in {
            "/b.png": "(HTTP status 404)",
            "/ftp": "(HTTP status 302)",  # a redirect to ftp:// is not followed
            "/garbage": "(BadStatusLine)",
            "/slow": "(the fetch took more than images.timeout_s (1 s))",
        }.items():
            with pytest.raises(ValueError, match=re.escape("could not be fetched " + why)):
                load_image(url + path, allowed)
        with pytest.raises(ValueError, match="set images.allow_urls"):
            load_image(f"{url}/a.png", ImageConfig())
    finally:
        server.shutdown()


def test_content_parts_keep_images_only_where_the_job_takes_them():
    messages = [SYSTEM, image_message("What is it?", "a.png")]
    images: list = []
    got = messages_from_value(json.dumps(messages), "messages", images)
    assert got[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert got[0]["content"] == SYSTEM["content"] and images == ["a.png"]
    hf_form = [{"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": "Q"}]}]
    assert messages_from_value(hf_form, "m", images) and images == ["a.png", "b.png"]
    with pytest.raises(RowError, match="takes text only; remove it \\(images run on engine.backend vllm"):
        messages_from_value(messages, "messages")
    with pytest.raises(RowError, match="names no image"):
        messages_from_value([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "m", [])
    with pytest.raises(RowError, match="type 'input_audio': this model takes text only"):
        messages_from_value([{"role": "user", "content": [{"type": "input_audio"}]}], "m", [])


def test_images_config_needs_the_vllm_backend(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="images run on engine.backend vllm, task generate"):
        ProcessorConfig(model=str(tiny_model), prompt={"messages_column": "m"}, images={"root": "/data"})
    with pytest.raises(ValueError, match="ImageConfig.root='https://h/x' is invalid"):
        ProcessorConfig(
            model=str(tiny_model),
            prompt={"messages_column": "m"},
            engine={"backend": "vllm"},
            images={"root": "https://h/x"},
        )
    spec = {
        "name": "x",
        "model": str(tiny_model),
        "input": {"path": "in.jsonl"},
        "prompt": {"messages_column": "m"},
        "output": {"path": "out"},
    }
    with pytest.raises(SpecError, match="images: images run with task: generate on engine.backend: vllm"):
        parse_spec({**spec, "images": {"allow_urls": True}})
    # A text-only model on the vLLM backend takes no image: without an images section the
    # row's error, with one the spec's
    opts = ProcessorConfig(model=str(tiny_model), prompt={"messages_column": "m"}, engine={"backend": "vllm"})
    assert opts.tokenize_options().images is None
    (tmp_path / "in.jsonl").write_text(json.dumps({"m": json.dumps([SYSTEM])}) + "\n")
    vllm_spec = {
        **spec,
        "input": {"path": str(tmp_path / "in.jsonl")},
        "output": {"path": str(tmp_path / "out")},
        "engine": {"backend": "vllm", "device": "cpu"},
        "images": {},
    }
    with pytest.raises(SpecError, match="images: the model takes text only"):
        preflight(parse_spec(vllm_spec))


def test_images_root_is_checked_before_any_work(vlm, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"m": json.dumps([SYSTEM])}) + "\n")
    spec = {
        "name": "x",
        "model": str(vlm),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"messages_column": "m"},
        "output": {"path": str(tmp_path / "out")},
        "engine": {"backend": "vllm", "device": "cpu"},
        "images": {"root": str(tmp_path / "nowhere")},
    }
    with pytest.raises(SpecError, match="images.root: .*nowhere is not a folder: give the folder holding the images"):
        preflight(parse_spec(spec))
    (tmp_path / "nowhere").mkdir()
    preflight(parse_spec(spec))


# --- tokenize and plan ---------------------------------------------------------------------


def _tokenized(vlm: Path, conversations: list[list[dict]], **config) -> pa.Table:
    cfg = ProcessorConfig(model=str(vlm), prompt={"messages_column": "messages"}, engine={"backend": "vllm"}, **config)
    rows = [{"messages": json.dumps(c), "_pf_error": None} for c in conversations]
    return Tokenize(cfg.tokenize_options())(pa.Table.from_pylist(rows))


def test_tokenize_places_images_and_the_plan_keys_them_by_content(vlm):
    a, b = png_bytes(1), png_bytes(2)
    conversations = [
        [SYSTEM, image_message("What is it?", data_url(a))],
        [SYSTEM, image_message("Which colours?", data_url(a))],
        [SYSTEM, image_message("What is it?", data_url(b))],
        [SYSTEM, {"role": "user", "content": "No picture here."}],
        [SYSTEM, image_message("What is it?", "data:image/png;base64,aGVsbG8=")],
    ]
    table = _tokenized(vlm, conversations)
    errors = table.column("_pf_error").to_pylist()
    assert errors[:4] == [None] * 4 and "in none of PNG, JPEG, WEBP, GIF, BMP, TIFF" in errors[4]
    tokens = table.column("_pf_tokens").to_pylist()
    image_token = json.loads((vlm / "config.json").read_text())["image_token_id"]
    at = table.column("_pf_image_at").to_pylist()
    assert [[j for j, t in enumerate(ids) if t == image_token] for ids in tokens] == at
    assert at[3] == [] and at[4] == [] and tokens[4] == []
    assert table.column("_pf_image_keys").to_pylist()[:3] == [[image_key(a)], [image_key(a)], [image_key(b)]]
    assert table.column("_pf_images").to_pylist()[:3] == [[a], [a], [b]]
    # Rows 0 and 2 have the same tokens but not the same image: the plan sees them apart from
    # the image on, and rows 0 and 1 alike up to the question.
    assert tokens[0] == tokens[2]
    keyed = plan_tokens(table)
    image_at = at[0][0]
    assert list(keyed[0][:image_at]) == list(keyed[2][:image_at]) and keyed[0][image_at] != keyed[2][image_at]
    assert list(keyed[0][: image_at + 1]) == list(keyed[1][: image_at + 1])
    hashes = block_hashes(keyed, block_size=4)
    first = image_at // 4  # the block holding the image
    assert list(hashes[0][:first]) == list(hashes[2][:first]) and hashes[0][first] != hashes[2][first]
    # Planned, the rows of one image form one group; the engine gets the real token ids.
    good = table.take(pa.array([0, 1, 2]))
    plan = build_plan(
        HashedPrompts.from_tokens(good.column("_pf_tokens"), 4, keyed=plan_tokens(good)), row_ids=np.arange(3)
    )
    groups = plan.groups(0)
    assert sorted(sorted(g.row_ids.tolist()) for g in groups) == [[0, 1], [2]]
    by_row = {int(r): g.prompt(i).tolist() for g in groups for i, r in enumerate(g.row_ids)}
    assert by_row == {i: tokens[i] for i in range(3)}


def test_a_template_without_the_image_token_is_the_rows_error(vlm):
    table = _tokenized(
        vlm,
        [[image_message("What is it?", data_url(png_bytes(1)))]],
    )
    assert table.column("_pf_error").to_pylist() == [None]
    cfg = ProcessorConfig(
        model=str(vlm),
        prompt={"messages_column": "messages"},
        engine={"backend": "vllm"},
        chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}",
    )
    rows = [{"messages": json.dumps([image_message("What is it?", data_url(png_bytes(1)))]), "_pf_error": None}]
    error = Tokenize(cfg.tokenize_options())(pa.Table.from_pylist(rows)).column("_pf_error")[0].as_py()
    assert "the prompt has 0 image placeholder tokens for 1 images" in error
    # the image token typed as text, with no image: the same count, the other way round
    literal = _tokenized(vlm, [[{"role": "user", "content": "What is <image> here?"}]])
    assert "the prompt has 1 image placeholder tokens for 0 images" in literal.column("_pf_error")[0].as_py()


# --- a whole job on vLLM -------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_vllm
@pytest.mark.slow
def test_image_job_on_vllm_killed_once_equals_transformers(ray_local, vlm, tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    for k in range(3):
        (pics / f"{k}.png").write_bytes(png_bytes(10 + k))
    (pics / "broken.png").write_bytes(b"not a picture")
    # 13 good rows, two at a time: the engine is killed after its first part of 2 with rows to go.
    questions = ("What is it?", "Which colours?", "Where is it?", "Count the shapes.")
    good = [
        [SYSTEM, image_message(q, f"{k}.png" if k else data_url(png_bytes(10)))] for q in questions for k in range(3)
    ]
    good.append([SYSTEM, {"role": "user", "content": "No picture here."}])
    bad = {
        "broken": [SYSTEM, image_message("What is it?", "broken.png")],
        "outside": [SYSTEM, image_message("What is it?", "../secret.png")],
        "url": [SYSTEM, image_message("What is it?", "http://127.0.0.1:9/a.png")],
    }
    rows = [{"id": i, "messages": json.dumps(c)} for i, c in enumerate(good)]
    rows += [{"id": name, "messages": json.dumps(c)} for name, c in bad.items()]
    rows = [{**r, "id": str(r["id"])} for r in rows]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    spec = {
        "name": "images",
        "model": str(vlm),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"messages_column": "messages"},
        "images": {"root": str(pics)},
        "sampling": {"temperature": 0, "max_tokens": 16},
        "engine": {
            "backend": "vllm",
            "dtype": "float32",
            "device": "cpu",
            "max_num_seqs": 2,
            "max_model_len": 512,
            "vllm": {"enforce_eager": True},
        },
        "replicas": 1,
        "output": {"path": str(out), "format": "jsonl", "rows_per_part": 2, "overwrite": False, "resume": True},
    }
    job = Driver(spec, tmp_path, "images", ray_local.get_runtime_context().gcs_address)
    expected = transformers_answers(vlm, good, max_tokens=16, images_root=pics)  # while the job starts

    def answered() -> list[dict]:  # parts of answers (the error records are committed apart)
        return [rec for rec in local_records(out) if min(rec["row_ids"]) < len(good)]

    wait_until(lambda: len(answered()) >= 1, job, "a committed part of answers")
    os.kill(worker_pid(answered()[0]), signal.SIGKILL)  # the vLLM engine actor that wrote it
    job.wait()

    assert check_output(str(out), rows) == {
        "output_rows": len(rows),
        "rows_lost": 0,
        "rows_duplicated": 0,
        "error_rows": len(bad),
    }
    got = {r["id"]: r for r in read_output(str(out))}
    assert {i: list(got[str(i)]["generated_tokens"]) for i in range(len(good))} == dict(enumerate(expected))
    assert "in none of PNG, JPEG, WEBP, GIF, BMP, TIFF" in got["broken"]["error"]
    assert "outside images.root" in got["outside"]["error"]
    assert "set images.allow_urls" in got["url"]["error"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["fault_tolerance"]["engine_failures"] == 1, metrics["fault_tolerance"]


@needs_vllm
@pytest.mark.slow
def test_rays_vision_example_through_our_face(ray_local, vlm, tmp_path):
    """Ray's documented vision example (docs.ray.io "Working with LLMs": a PIL image in an
    `image` part, prepare_multimodal_stage on) with only the import changed; an image_url with
    a path under allowed_local_media_path too. Answers equal transformers'."""
    import ray
    from PIL import Image

    from prefixflow import build_processor, vLLMEngineProcessorConfig  # was: from ray.data.llm import ...

    (tmp_path / "1.png").write_bytes(png_bytes(21))
    config = vLLMEngineProcessorConfig(
        model_source=str(vlm),
        engine_kwargs={"max_model_len": 512, "enforce_eager": True},
        prepare_multimodal_stage={"enabled": True, "model_config_kwargs": {"allowed_local_media_path": str(tmp_path)}},
        batch_size=4,
        concurrency=1,
    )

    pil = Image.open(io.BytesIO(png_bytes(20))).convert("RGB")  # the closure takes it by value

    def preprocess(row: dict) -> dict:
        picture = (
            {"type": "image", "image": pil}
            if row["id"] % 2 == 0
            else {"type": "image_url", "image_url": {"url": "1.png"}}
        )
        return dict(
            messages=[SYSTEM, {"role": "user", "content": [{"type": "text", "text": row["q"]}, picture]}],
            sampling_params=dict(temperature=0, max_tokens=8, detokenize=False),
        )

    processor = build_processor(
        config, preprocess=preprocess, postprocess=lambda row: dict(id=row["id"], tokens=row["generated_tokens"])
    )
    questions = ["What is it?", "What is it?", "Which colours?", "Which colours?"]
    rows = processor(ray.data.from_items([{"id": i, "q": q} for i, q in enumerate(questions)])).take_all()
    got = {r["id"]: list(r["tokens"]) for r in rows}
    conversations = [
        [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": q},
                    {"type": "image_url", "image_url": {"url": data_url(png_bytes(20)) if i % 2 == 0 else "1.png"}},
                ],
            },
        ]
        for i, q in enumerate(questions)
    ]
    assert got == dict(enumerate(transformers_answers(vlm, conversations, max_tokens=8, images_root=tmp_path)))


def test_openai_batch_chat_request_with_an_image(vlm):
    """A /v1/chat/completions request's image_url part reaches the tokenize stage, which takes it
    on a vision-language job and makes it the request's error on a text one."""
    from prefixflow.operators.stages.openai_batch import parse_requests
    from prefixflow.operators.stages.read import parse_jsonl

    body = {"messages": [SYSTEM, image_message("What is it?", data_url(png_bytes(3)))], "max_tokens": 4}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    rows = parse_requests(parse_jsonl(json.dumps(line).encode(), "b.jsonl"))
    assert rows[0]["_pf_error"] is None
    cfg = ProcessorConfig(model=str(vlm), openai_batch=True, engine={"backend": "vllm"})
    table = Tokenize(cfg.tokenize_options())(pa.Table.from_pylist(rows))
    assert table.column("_pf_error").to_pylist() == [None]
    assert table.column("_pf_images").to_pylist() == [[png_bytes(3)]]
    text = ProcessorConfig(model=str(vlm), openai_batch=True)  # the native backend takes text only
    error = Tokenize(text.tokenize_options())(pa.Table.from_pylist(rows)).column("_pf_error")[0].as_py()
    assert "type 'image_url': this model takes text only" in error
