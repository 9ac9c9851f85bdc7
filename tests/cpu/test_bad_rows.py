"""Bad rows and bad values never stop a job (issue 12): each becomes that row's error record.

Function-level tests need no Ray; the whole jobs run on the session's real local Ray with the
tiny checkpoint, a dozen rows and max_tokens 4.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.columns import ERROR
from prefixflow.operators.results.outputs import OUTPUT_FIELDS, with_outputs
from prefixflow.operators.stages.openai_batch import parse_requests
from prefixflow.operators.stages.read import parse_csv, parse_jsonl, rows_to_table
from prefixflow.requests import SamplingParams

BAD_SAMPLING = [  # (override, the field its error names)
    ({"stop": [1]}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"top_k": 1e30}, "top_k"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"temperature": True}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": "0.9"}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"min_tokens": 2.5}, "min_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"beam_width": 2}, "beam_width"),  # vLLM beam search: not a sampling field
]


# --- case 1 and 7: sampling values are checked in one place ---------------------------------


@pytest.mark.parametrize("override, field", BAD_SAMPLING)
def test_bad_sampling_value_is_a_value_error_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams().with_overrides(override)


def test_sampling_params_accept_integral_floats_and_clip_nothing():
    p = SamplingParams(top_k=5.0, max_tokens=3.0, seed=2**63 - 1, stop="x", stop_token_ids=[7.0], temperature=0)
    assert (p.top_k, p.max_tokens, p.stop, p.stop_token_ids, p.temperature) == (5, 3, ("x",), (7,), 0.0)
    assert isinstance(p.top_k, int) and isinstance(p.temperature, float)
    q = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), stop_token_ids=np.array([3]))
    assert (q.top_k, q.temperature, q.stop_token_ids) == (5, 0.5, (3,)) and type(q.top_k) is int
    assert SamplingParams().with_overrides({"top_k": None, "temperature": 0}).temperature == 0.0
    with pytest.raises(ValueError, match="unknown sampling parameter 'beam_width'.*temperature"):
        SamplingParams().with_overrides({"beam_width": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams().with_overrides([1, 2])


_values = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300)
    | st.floats()
    | st.text(max_size=5)
    | st.lists(st.integers() | st.text(max_size=3) | st.floats(), max_size=3)
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([f.name for f in dataclasses.fields(SamplingParams)] + ["beam_width", "best_of"]),
        _values,
        max_size=5,
    )
)
def test_fuzzed_overrides_make_params_or_a_value_error(overrides):
    try:
        p = SamplingParams().with_overrides(overrides)
    except ValueError as e:
        assert str(e).startswith(("SamplingParams.", "unknown sampling parameter")), e
        return
    assert p.max_tokens <= 2**31 - 1 and (p.seed is None or 0 <= p.seed < 2**63) and hash(p) is not None


def test_spec_sampling_gets_the_same_checks():
    base = {"model": "/m", "input": {"path": "in.jsonl"}, "prompt": {"template": "{{ q }}"}, "output": {"path": "out"}}
    for key, value in (("top_k", 1e20), ("max_tokens", 2**40), ("seed", -5)):
        with pytest.raises(SpecError) as e:
            parse_spec({**base, "sampling": {key: value}})
        assert [p for p, _ in e.value.problems] == [f"sampling.{key}"], e.value.problems


def test_tokenize_makes_bad_sampling_rows_error_records(tiny_model):
    from prefixflow.operators.config import TokenizeOptions
    from prefixflow.operators.stages.tokenize import Tokenize
    from prefixflow.operators.template import PromptTemplate

    tok = Tokenize(
        TokenizeOptions(
            model=str(tiny_model),
            prompt=PromptTemplate(template="Q: {{ q }}"),
            max_model_len=256,
            sampling=SamplingParams(max_tokens=4),
        )
    )
    cases = [(json.dumps(o), f) for o, f in BAD_SAMPLING] + [("[1, 2]", "mapping"), ("[" * 5000, "JSON")]
    good = [None, json.dumps({"temperature": 0, "top_k": 10**6}), json.dumps({"seed": None})]
    values = [v for v, _ in cases] + good
    table = tok(
        pa.table({"q": ["hello"] * len(values), "sampling_params": values, ERROR: pa.nulls(len(values), pa.string())})
    )
    errors = table.column(ERROR).to_pylist()
    for (_, field), error in zip(cases, errors):
        assert error and "invalid sampling parameters for this row" in error and field in error, error
    assert errors[len(cases) :] == [None] * len(good)


# --- case 2: an exception inside the engine fails only its row -------------------------------


def _failing_engine(model: str, bad_row: int):
    """Our own LLMEngine with one method made to raise for one row: after case 1 no real
    per-row trigger is known, so the failure is injected (the engine and model are real)."""
    from prefixflow.engine import LLMEngine
    from prefixflow.engine.config import EngineConfig

    class FailsOnRow(LLMEngine):
        def _on_token(self, seq, token):
            if seq.row_id == bad_row:
                raise TypeError(f"injected failure for row {bad_row}")
            return super()._on_token(seq, token)

    return FailsOnRow(EngineConfig(model=model, device="cpu", kv_cache_bytes=16 << 20))


def test_an_engine_exception_fails_only_its_row(tiny_model):
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.operators.stages.generate import group_outputs
    from prefixflow.pipeline import build_plan

    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 20).tolist()
    prompts = [shared + rng.integers(3, 200, n).tolist() for n in (2, 5, 3, 7)] + [[5, 6, 7], [9, 8]]
    plan = build_plan(prompts, row_ids=list(range(len(prompts))), order="batchllm", min_prefix_len=4)
    groups = plan.groups(0)
    assert any(g.num_members > 1 and 2 in g.row_ids for g in groups)  # the bad row shares a prefix
    config = ProcessorConfig(model=str(tiny_model), sampling={"temperature": 0, "max_tokens": 4})
    rows = pa.table({"q": [str(i) for i in range(len(prompts))]})
    row_ids = np.arange(len(prompts))

    healthy = {o.row_id: o for o in group_outputs(_failing_engine(str(tiny_model), -1), config, groups, rows, row_ids)}
    engine = _failing_engine(str(tiny_model), 2)
    outs = list(group_outputs(engine, config, groups, rows, row_ids))
    assert sorted(o.row_id for o in outs) == list(range(len(prompts)))  # each row once
    by_row = {o.row_id: o for o in outs}
    assert by_row[2].error == "the engine failed on this row: TypeError: injected failure for row 2"
    for r in by_row:
        if r != 2:
            assert by_row[r].error is None and by_row[r].token_ids == healthy[r].token_ids
    # The engine was reset and runs again.
    again = list(group_outputs(engine, config, [g for g in groups if 2 not in g.row_ids], rows, row_ids))
    assert all(o.error is None for o in again)


def test_an_engine_that_fails_on_every_row_stops_the_replica(tiny_model):
    """A broken engine (every request raises) is not a dataset of bad rows: after
    MAX_FAILURES_IN_A_ROW rows fail alone with none running in between, EngineBroken is raised
    (the job stops, committed rows kept) instead of the replica becoming error records."""
    from prefixflow.engine import LLMEngine
    from prefixflow.engine.config import EngineConfig
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.operators.stages.generate import group_outputs
    from prefixflow.operators.stages.isolate import MAX_FAILURES_IN_A_ROW, EngineBroken
    from prefixflow.pipeline import build_plan

    class Broken(LLMEngine):
        def _on_token(self, seq, token):
            raise RuntimeError("device lost")

    n = MAX_FAILURES_IN_A_ROW + 4
    prompts = [[3 + i, 4, 5 + i] for i in range(n)]
    groups = build_plan(prompts, row_ids=list(range(n)), order="fcfs").groups(0)
    config = ProcessorConfig(model=str(tiny_model), sampling={"temperature": 0, "max_tokens": 2})
    engine = Broken(EngineConfig(model=str(tiny_model), device="cpu", kv_cache_bytes=16 << 20))
    outs = []
    with pytest.raises(EngineBroken, match="device lost"):
        for out in group_outputs(engine, config, groups, pa.table({"q": ["x"] * n}), np.arange(n)):
            outs.append(out)
    assert len(outs) == MAX_FAILURES_IN_A_ROW - 1  # the rows before the verdict, as errors


def test_a_scorer_exception_fails_only_its_row(tiny_model):
    from prefixflow.engine import Scorer
    from prefixflow.engine.config import EngineConfig
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.operators.results.outputs import output_chunk
    from prefixflow.operators.stages.generate import group_outputs
    from prefixflow.pipeline import build_plan

    class FailsOnRow(Scorer):  # our own Scorer, one method made to raise for row 1 (see above)
        def _run(self, reqs, cache, stats, work):  # one request, or several packed
            if any(r.row_id == 1 for r in reqs):
                raise RuntimeError("injected scorer failure")
            return super()._run(reqs, cache, stats, work)

    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11], [20, 21, 22]]
    groups = build_plan(prompts, row_ids=[0, 1, 2], order="batchllm", min_prefix_len=4).groups(0)
    config = ProcessorConfig(
        model=str(tiny_model), task="score", score={"choices": ["Yes", "No"]}, prompt={"template": "{{ q }}"}
    )
    rows = pa.table({"q": ["a", "b", "c"]})
    scorer = FailsOnRow(EngineConfig(model=str(tiny_model), device="cpu"), config.score.options())
    outs = list(group_outputs(scorer, config, groups, rows, np.arange(3)))
    by_row = {o.row_id: o for o in outs}
    assert sorted(by_row) == [0, 1, 2] and len(outs) == 3
    assert by_row[1].error == "the engine failed on this row: RuntimeError: injected scorer failure"
    assert by_row[0].error is None and by_row[2].error is None and by_row[0].label in ("Yes", "No")
    ids = [int(o.row_id) for o in outs]
    n = np.zeros(len(outs), np.int64)
    table = output_chunk(outs, rows.take(pa.array(ids)), n, n.astype(float), n, replica=0, plan_replica=0, task="score")
    assert table.column("error").null_count == 2 and table.column("label").null_count == 1


# --- case 3: lines Python parses but Arrow cannot store --------------------------------------


def test_lone_surrogates_and_deep_nesting_become_error_records():
    deep = b'{"q": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    data = b"\n".join(
        [b'{"q": "\\ud800"}', b'{"q": "pair \\ud83d\\ude00"}', deep, b'{"q": "ok"}', b'{"q": "text \\\\ud800"}']
    )
    recs = parse_jsonl(data, "f.jsonl")
    table = rows_to_table(recs)  # raised UnicodeEncodeError
    errors = table.column(ERROR).to_pylist()
    assert "line 1 is not valid Unicode (lone surrogate" in errors[0]
    assert "line 3 is nested too deeply" in errors[2]
    assert [errors[i] for i in (1, 3, 4)] == [None] * 3
    assert table.column("q").to_pylist()[1] == "pair \U0001f600"


def test_openai_lines_with_lone_surrogates_or_bad_escapes_keep_their_custom_id():
    data = b"\n".join(
        [
            b'{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}',
            b'{"custom_id": "a\\qb", "body": ',
            b'{"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "\\udc00"}}',
        ]
    )
    rows = rows_to_table(parse_requests(parse_jsonl(data, "f.jsonl"))).to_pylist()  # raised
    assert [r["custom_id"] for r in rows] == ["\\ud800", "a\\qb", "ok"]  # as the lines spell them
    assert "lone surrogate" in rows[0][ERROR] and "not valid JSON" in rows[1][ERROR]
    assert "lone surrogate" in rows[2][ERROR]


def test_csv_non_utf8_value_fails_its_row_only():
    # A lone surrogate cannot reach a CSV row as text: its UTF-8 form is invalid bytes, which
    # made Arrow read the whole column as binary.
    data = "q,n\nhello,1\n\ud800bad,2\nbye,3\n".encode("utf-8", "surrogatepass")
    rows = parse_csv(data, "f.csv").to_pylist()
    assert [r["q"] for r in rows] == ["hello", None, "bye"]
    assert [r[ERROR] is None for r in rows] == [True, False, True]
    assert "row 2, column 'q', is not valid UTF-8 (byte 0xed)" in rows[1][ERROR]


# --- case 4: OpenAI logprobs fields -----------------------------------------------------------


def test_openai_logprobs_null_is_off_and_wrong_types_are_request_errors():
    chat = {"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    text = {"url": "/v1/completions", "body": {"prompt": "hi"}}
    cases = [  # (request, None: ok with this logprobs, else the field the error names)
        (chat, {"logprobs": None, "top_logprobs": None}, None),
        (chat, {"logprobs": True, "top_logprobs": None}, 0),
        (chat, {"logprobs": True, "top_logprobs": 3}, 3),
        (chat, {"logprobs": False, "top_logprobs": 3}, None),
        (text, {"logprobs": None}, None),
        (text, {"logprobs": 2}, 2),
        (chat, {"logprobs": [1]}, "body.logprobs"),
        (chat, {"logprobs": True, "top_logprobs": [1]}, "body.top_logprobs"),
        (chat, {"logprobs": True, "top_logprobs": 50}, "logprobs"),
        (text, {"logprobs": [1]}, "body.logprobs"),
        (text, {"logprobs": "2"}, "body.logprobs"),
        (chat, {"seed": "abc"}, "seed"),
        (chat, {"stop": [1]}, "stop"),
    ]
    recs = [{"custom_id": f"r{i}", **req, "body": {**req["body"], **extra}} for i, (req, extra, _) in enumerate(cases)]
    rows = parse_requests(recs)  # raised TypeError
    for row, (_, _, want) in zip(rows, cases):
        if isinstance(want, str):
            assert row[ERROR] and want in row[ERROR], row
            continue
        assert row[ERROR] is None, row
        got = json.loads(row["_pf_sampling"]).get("logprobs") if row["_pf_sampling"] else None
        assert got == want, row


def test_openai_max_tokens_and_max_completion_tokens_must_agree():
    """Issue 43: both limits given and different: the request is an error record naming both
    (never the smaller, or either one, run silently); equal, it runs with that limit."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    recs = [
        {"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": {**body, **extra}}
        for i, extra in enumerate(
            [
                {"max_tokens": 5, "max_completion_tokens": 9},
                {"max_tokens": 9, "max_completion_tokens": 5},
                {"max_tokens": 7, "max_completion_tokens": 7},
                {"max_tokens": None, "max_completion_tokens": 6},
            ]
        )
    ]
    rows = parse_requests(recs)
    for row in rows[:2]:
        assert "body.max_tokens" in row[ERROR] and "body.max_completion_tokens" in row[ERROR], row
        assert "disagree" in row[ERROR] and row["custom_id"] in ("r0", "r1")
    assert [json.loads(r["_pf_sampling"])["max_tokens"] for r in rows[2:]] == [7, 6]
    assert rows[2][ERROR] is None and rows[3][ERROR] is None


def test_a_duplicate_custom_id_is_reported_when_its_first_use_is_an_error_record(ray_local, tiny_model):
    """Issue 43: a custom_id first used by a broken line or an invalid request, then by a good
    request: the good one is reported as the duplicate (each custom_id answers one request)."""
    import ray

    from prefixflow.operators.config import TokenizeOptions
    from prefixflow.operators.stages.plan import plan_dataset
    from prefixflow.operators.stages.tokenize import Tokenize
    from prefixflow.operators.stages.window_plans import plan_windows

    lines = [
        b'{"custom_id": "broken", "url": "/v1/completions", "body": {',
        json.dumps({"custom_id": "invalid", "url": "/v1/embeddings", "body": {}}).encode(),
        json.dumps({"custom_id": "fine", "url": "/v1/completions", "body": {"prompt": "a"}}).encode(),
    ]
    lines += [
        json.dumps({"custom_id": cid, "url": "/v1/completions", "body": {"prompt": "b"}}).encode()
        for cid in ("broken", "invalid", "fine")
    ]
    table = rows_to_table(parse_requests(parse_jsonl(b"\n".join(lines), "f.jsonl")))
    tokenized = Tokenize(TokenizeOptions(model=str(tiny_model), prompt=None, max_model_len=64))(table)
    blocks = [tokenized.slice(0, 4), tokenized.slice(4)]  # first uses and duplicates in two blocks
    planned = plan_dataset(ray.data.from_arrow(blocks), order="batchllm", num_replicas=1, custom_ids=True)
    assert sorted(planned.extra_errors) == [3, 4, 5]
    for row, first in ((3, 0), (4, 1), (5, 2)):
        assert f"(first used by row {first})" in planned.extra_errors[row]
    assert planned.plan.summary["num_rows"] == 1 and sorted(planned.error_row_ids.tolist()) == [0, 1, 3, 4, 5]
    # Planned in windows (one block each; 4 asked at once, one at a time for custom_ids): the
    # second window's duplicates are found against the first window's custom_ids.
    windows = list(plan_windows(ray.data.from_arrow(blocks), 2, 4, order="batchllm", num_replicas=1, custom_ids=True))
    assert [w.rows.num_rows for w in windows] == [4, 2]
    assert {row: e for w in windows for row, e in w.extra_errors.items()} == planned.extra_errors


# --- case 6: input columns named like output columns -----------------------------------------


def test_input_columns_named_like_outputs_are_kept_as_input_name():
    rows = pa.table(
        {
            "q": ["a"],
            "error": ["mine"],
            "row_id": [77],
            "input_error": ["x"],
            "_pf_prompt": ["P"],
            "prompt": ["user prompt"],
            "_pf_error": [None],
        }
    )
    columns = {f.name: [None] for f in OUTPUT_FIELDS} | {"row_id": [0], "generated_tokens": [[]]}
    out = with_outputs(rows, columns).to_pylist()[0]
    assert out["input_error"] == "x" and out["input_input_error"] == "mine" and out["input_row_id"] == 77
    assert out["input_prompt"] == "user prompt" and out["prompt"] == "P"
    assert out["row_id"] == 0 and out["error"] is None and "_pf_error" not in out


def test_generator_mode_keeps_the_batchs_own_columns(tiny_model):
    from prefixflow.operators.faces.batch_generator import Generator

    gen = Generator(
        model=str(tiny_model),
        prompt={"template": "Q: {{ q }}"},
        sampling={"temperature": 0, "max_tokens": 2},
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20},
    )
    batch = pa.table(
        {
            "q": ["a", "b", "c"],
            "row_id": [7, 8, 9],
            "error": ["x", "y", "z"],
            "sampling_params": [None, '{"stop": [1]}', None],
        }
    )
    out = gen(batch).to_pylist()
    assert [r["row_id"] for r in out] == [7, 8, 9]  # ours is dropped in this mode: theirs stays
    assert [r["input_error"] for r in out] == ["x", "y", "z"]
    assert out[0]["error"] is None and out[2]["error"] is None and "stop" in out[1]["error"]


# --- whole jobs --------------------------------------------------------------------------------


def _run(tmp_path, tiny_model, input: dict, prompt: dict):
    from prefixflow.jobs.run import run_job
    from prefixflow.operators.results.write import read_output

    spec = parse_spec(
        {
            "model": str(tiny_model),
            "input": input,
            "prompt": prompt,
            "sampling": {"temperature": 0, "max_tokens": 4},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl", "rows_per_part": 4},
        }
    )
    run_job(spec, quiet=True)
    return read_output(str(tmp_path / "out"))


@pytest.mark.slow
def test_job_with_bad_values_and_clashing_columns_finishes(ray_local, tiny_model, tmp_path):
    lines = [json.dumps({"q": f"question {i}", "error": f"e{i}", "row_id": 100 + i}) for i in range(6)]
    lines.append(
        json.dumps(
            {
                "q": "big top_k",
                "error": "e6",
                "row_id": 106,
                "sampling_params": {"top_k": 10**6, "temperature": 0.5, "seed": 1},
            }
        )
    )
    bad = BAD_SAMPLING[:4] + BAD_SAMPLING[-1:]  # stop [1], seed "abc", top_k 1e30, max_tokens 2**70, beam_width
    for i, (override, _) in enumerate(bad):
        lines.append(json.dumps({"q": "bad", "error": f"b{i}", "row_id": 200 + i, "sampling_params": override}))
    lines += ['{"q": "\\ud800", "row_id": 300}', '{"q": ' + "[" * 10000 + "]" * 10000 + "}"]
    # Rows that bomb the template (a string of 10**12 characters, 10**10 loop steps) and a
    # temperature too small to sample with: each its own error record, the job goes on.
    hostile = {"mul": 400, "loop": 401, "temp": 402}
    for q, row_id in hostile.items():
        tiny = {"sampling_params": {"temperature": 1e-40}} if q == "temp" else {}
        lines.append(json.dumps({"q": q, "row_id": row_id, **tiny}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    template = (  # "Q: {{ q }}" for every other row
        "{% if q == 'mul' %}{{ 'a' * 10**12 }}{% elif q == 'loop' %}"
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}Q: {{ q }}"
    )
    out = _run(tmp_path, tiny_model, {"path": str(tmp_path / "in.jsonl")}, {"template": template})
    assert len(out) == len(lines) and sorted(r["row_id"] for r in out) == list(range(len(lines)))
    by_input = {r.get("input_row_id"): r for r in out}
    for i in range(7):  # good rows ran, and kept their own `error` and `row_id` columns
        r = by_input[100 + i]
        assert r["error"] is None and r["num_generated_tokens"] >= 1 and r["input_error"] == f"e{i}", r
    for i, (_, field) in enumerate(bad):
        r = by_input[200 + i]
        assert r["input_error"] == f"b{i}" and field in r["error"] and r["generated_text"] is None, r
    unreadable = sorted(r["error"] for r in out if r.get("input_row_id") is None)
    assert len(unreadable) == 2  # the two lines Arrow cannot store: no columns, only the error
    assert "line 13 is not valid Unicode (lone surrogate" in unreadable[0]
    assert "line 14 is nested too deeply" in unreadable[1]
    for q in ("mul", "loop"):
        assert "prompt.template exceeded a template limit" in by_input[hostile[q]]["error"], by_input[hostile[q]]
    assert "temperature=1e-40 is invalid" in by_input[hostile["temp"]]["error"], by_input[hostile["temp"]]


@pytest.mark.slow
def test_parquet_files_with_clashing_schemas(ray_local, tiny_model, tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"q": [1, 2, 3], "k": ["a", "b", "c"]}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"q": ["four", "five"], "k": ["d", "e"]}), tmp_path / "in" / "b.parquet")
    out = _run(
        tmp_path, tiny_model, {"path": str(tmp_path / "in"), "format": "parquet"}, {"template": "Q: {{ q }} {{ k }}"}
    )
    assert sorted(r["q"] for r in out) == ["1", "2", "3", "five", "four"]
    assert all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in out)


def test_python_api_sampling_dict_names_an_unknown_key(tiny_model):
    """ProcessorConfig(sampling={...}) goes through the same check as specs and rows: an
    unknown key is a ValueError naming it (it was a TypeError)."""
    from prefixflow.operators.config import ProcessorConfig

    with pytest.raises(ValueError, match="unknown sampling parameter 'beam_width'"):
        ProcessorConfig(model=str(tiny_model), sampling={"beam_width": 2})
    with pytest.raises(ValueError, match="SamplingParams.top_k"):
        ProcessorConfig(model=str(tiny_model), sampling={"top_k": 1e30})
