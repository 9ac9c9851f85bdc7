"""engine.backend: http, its protocol (fast): the settings checked by name; an endpoint's
retries (500/503/429 then 200, Retry-After honoured), refusals (a 400 is the row's error with
the server's message, not retried), pacing to qps, the key read from an environment variable;
and HttpEngine sending the plan's rows in plan order as token-id completions and reading the
answers (token ids, text, cached prompt tokens, n samples, logprobs by token id). The servers
here are scripted loopback servers (tests/support/openai_server.py); tests/cpu/test_http_jobs.py
runs whole jobs against real `vllm serve` servers."""

from __future__ import annotations

import pytest

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.http_backend.client import Endpoint, EndpointDown, RequestFailed
from prefixflow.engine.http_backend.config import HttpConfig
from prefixflow.engine.http_backend.engine import HttpEngine, completion_body
from prefixflow.requests import SamplingParams
from support.openai_server import ScriptedServer

MODEL = "served-tiny"


def completion(token_ids: list[int], text: str = "x", cached: int = 0, finish: str = "length", index: int = 0):
    """One vLLM-style completion answer (choices with return_token_ids' token_ids)."""
    return {
        "choices": [{"index": index, "text": text, "finish_reason": finish, "token_ids": token_ids}],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": len(token_ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def endpoint(url: str, **settings) -> tuple[Endpoint, list[float]]:
    """An Endpoint whose waits are recorded instead of slept (no test waits on the clock)."""
    waits: list[float] = []
    config = HttpConfig.of({"endpoints": [url], **settings})
    return Endpoint(config.endpoints[0], config, waits.append), waits


def test_settings_are_checked_by_name_and_one_replica_runs_per_endpoint(tiny_model):
    import prefixflow

    servers = ["http://127.0.0.1:8001", "http://127.0.0.1:8002/v1/"]
    config = prefixflow.ProcessorConfig(
        model=str(tiny_model), engine={"backend": "http", "http": {"endpoints": servers}}
    )
    assert config.replicas == 2 and config.http_config is not None
    assert config.http_config.endpoints == ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1")
    bad = {
        "engine.http.endpoints[0]": {"endpoints": ["ftp://x"]},
        "engine.http.max_concurency": {"endpoints": servers, "max_concurency": 2},
        "engine.http.qps": {"endpoints": servers, "qps": 0},
        "engine.http.max_retries": {"endpoints": servers, "max_retries": -1},
        "engine.http.endpoints": {"endpoints": [servers[0], servers[0]]},
        "engine.http.endpoints[1]": {"endpoints": [servers[0], "http://h:1/v1/completions"]},
        "engine.http.max_concurrency": {"endpoints": servers, "max_concurrency": 5000},
    }
    for name, http in bad.items():
        with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
            prefixflow.ProcessorConfig(model=str(tiny_model), engine={"backend": "http", "http": http})
    for url in ("http://h:abc", "http://[::1"):
        with pytest.raises(ValueError, match="endpoints\\[0\\].*give an http:// or https:// URL with a host"):
            prefixflow.ProcessorConfig(model=str(tiny_model), engine={"backend": "http", "http": {"endpoints": [url]}})
    for http in ({"endpoints": ["http://h:1/?key=s3cret"]}, {"endpoints": servers, "api_key_env": "s3cret-key"}):
        with pytest.raises(ValueError) as e:  # what may be a key is never echoed
            prefixflow.ProcessorConfig(model=str(tiny_model), engine={"backend": "http", "http": http})
        assert "<hidden>" in str(e.value) and "s3cret" not in str(e.value)
    with pytest.raises(ValueError, match="engine.http.endpoints\\[0\\]='<hidden>'"):  # a password is never echoed
        prefixflow.ProcessorConfig(
            model=str(tiny_model), engine={"backend": "http", "http": {"endpoints": ["http://u:secret@h:1"]}}
        )
    with pytest.raises(ValueError, match="ProcessorConfig.replicas=3 .* one replica per endpoint"):
        prefixflow.ProcessorConfig(
            model=str(tiny_model), replicas=3, engine={"backend": "http", "http": {"endpoints": servers}}
        )
    with pytest.raises(
        ValueError, match="ProcessorConfig.task='embed' is invalid: engine.backend: http runs task generate"
    ):
        prefixflow.ProcessorConfig(
            model=str(tiny_model), task="embed", engine={"backend": "http", "http": {"endpoints": servers}}
        )
    with pytest.raises(ValueError, match="engine.http.* need engine.backend: http"):
        prefixflow.ProcessorConfig(model=str(tiny_model), engine={"http": {"endpoints": servers}})


def test_an_endpoint_retries_busy_answers_and_refusals_are_the_rows_error():
    ok = completion([5, 6])
    script = [
        (500, {"error": {"message": "boom"}}, {}),
        (503, "down", {}),
        (429, {}, {"Retry-After": "3"}),
        (200, ok, {}),
    ]
    with ScriptedServer(script) as server:
        ep, waits = endpoint(server.url, backoff_s=0.5)
        assert ep.post("/completions", {"prompt": [1]}) == ok
        assert ep.retries == 3 and waits == [0.5, 1.0, 3.0]  # doubled backoff; Retry-After over 2.0
        server.script.append((400, {"error": {"message": "This model's maximum context length is 32"}}, {}))
        with pytest.raises(RequestFailed, match="refused the request: HTTP 400: This model's maximum context length"):
            ep.post("/completions", {"prompt": [1]})
        assert ep.retries == 3  # a refusal is not retried
        # retries spent on a server that answers /models: this request's fault, the row's error
        server.script.extend([(502, "bad gateway", {})] * 3)
        ep, waits = endpoint(server.url, max_retries=2, backoff_s=0.1)
        with pytest.raises(
            RequestFailed, match="failed \\(HTTP 502: bad gateway\\) after 3 attempts; the server answers"
        ):
            ep.post("/completions", {})
        assert waits == [0.1, 0.2]
        # ... on one that does not: the server is down, no row is to blame
        server.script.extend([(503, "restarting", {})] * 2)
        server.get_script.append((503, "restarting", {}))
        with pytest.raises(EndpointDown, match="failed \\(HTTP 503: restarting\\) after 2 attempts$"):
            endpoint(server.url, max_retries=1)[0].post("/completions", {})
        for status, field in ((401, "api_key_env"), (404, "engine.http.model")):  # the key, the model: not retried
            server.script.append((status, {"error": {"message": "no"}}, {}))
            with pytest.raises(EndpointDown, match=f"refused it: HTTP {status}: no .*{field}"):
                ep.post("/completions", {})
        server.script.append((302, "", {"Location": "http://example.com/"}))  # never followed (the key)
        with pytest.raises(RequestFailed, match="HTTP 302"):
            ep.post("/completions", {})
    ep, waits = endpoint(server.url, max_retries=1, backoff_s=0.1)  # closed: nothing listens now
    with pytest.raises(EndpointDown, match="failed \\(no answer: .*\\) after 2 attempts"):
        ep.post("/completions", {})


def test_an_endpoint_paces_requests_and_sends_the_key_from_the_environment(monkeypatch):
    with ScriptedServer(default={"ok": True}) as server:
        ep, waits = endpoint(server.url, qps=4)
        for _ in range(3):
            ep.post("/completions", {})
        assert len(waits) == 2 and all(0.2 < w <= 0.5 for w in waits)  # 1/qps apart, measured to the start
        monkeypatch.setenv("PF_TEST_KEY", "k-123")
        ep, _ = endpoint(server.url, api_key_env="PF_TEST_KEY")
        ep.post("/completions", {})
        assert server.headers[-1]["Authorization"] == "Bearer k-123"
    monkeypatch.delenv("PF_TEST_KEY")
    with pytest.raises(ValueError, match="api_key_env=PF_TEST_KEY: the variable is not set"):
        endpoint(server.url, api_key_env="PF_TEST_KEY")


def test_the_engine_sends_rows_in_plan_order_and_reads_the_answers(tiny_model):
    from prefixflow.pipeline import build_plan

    shared = list(range(10, 30))
    prompts = [shared + [40 + i] * (i + 1) for i in range(4)] + [[7, 8, 9]]
    plan = build_plan(prompts, row_ids=list(range(5)), order="batchllm", min_prefix_len=8)
    order = [int(r) for g in plan.groups(0) for r in g.row_ids]
    lp = {
        "tokens": ["token_id:5", "token_id:6"],
        "token_logprobs": [-0.1, -0.2],
        # vLLM lists the sampled token first, then the top k: at 1, the sampled 6 is an extra
        "top_logprobs": [{"token_id:5": -0.1, "token_id:9": -2.0}, {"token_id:6": -0.9, "token_id:8": -0.2}],
    }
    answers = {
        order[0]: (
            200,
            {
                **completion([5, 6], "ab", cached=0),
                "choices": [{"index": 0, "text": "ab", "finish_reason": "length", "token_ids": [5, 6], "logprobs": lp}],
            },
            {},
        ),
        order[1]: (400, {"error": {"message": "bad row"}}, {}),
        order[4]: (200, completion([3], "c", finish="abort"), {}),  # vLLM aborted it: not an answer
    }
    script = [answers.get(r, (200, completion([3], "c", cached=16, finish="stop"), {})) for r in order]
    with ScriptedServer(script) as server:
        http = HttpConfig.of({"endpoints": [server.url], "max_concurrency": 1, "model": MODEL})
        engine = HttpEngine(EngineConfig(model=str(tiny_model), device="cpu"), http)
        params = {
            r: SamplingParams(temperature=0, max_tokens=2, logprobs=1 if r == order[0] else None) for r in range(5)
        }
        params[order[2]] = SamplingParams(temperature=0, max_tokens=2, n=3)  # greedy n: sent once
        outs = {o.row_id: o for o in engine.run(plan.groups(0), params)}
    sent = [body for _, body in server.requests]
    assert [b["prompt"] for b in sent] == [prompts[r] for r in order]  # plan order, token ids
    assert all(b["model"] == MODEL and b["return_token_ids"] is True and b["n"] == 1 for b in sent)
    first = outs[order[0]]
    assert first.token_ids == (5, 6) and first.text == "ab"
    assert [t.top for t in first.logprobs] == [((5, -0.1),), ((8, -0.2),)]
    assert outs[order[1]].error == f"{http.endpoints[0]}/completions refused the request: HTTP 400: bad row"
    assert outs[order[1]].finish_reason == "abort"
    assert len(outs[order[2]].samples) == 3 and outs[order[2]].finish_reason == "stop"
    assert outs[order[3]].num_cached_tokens == 16  # the server's prompt_tokens_details
    assert "finish_reason='abort'" in outs[order[4]].error
    totals = engine.totals
    assert totals.num_requests == 5 and totals.num_prompt_tokens == sum(len(p) for p in prompts)
    assert totals.num_output_tokens == 2 + 1 + 1  # usage.completion_tokens of the rows answered


def test_a_server_that_stops_answering_stops_the_run_instead_of_failing_its_rows(tiny_model):
    """Retries spent and /models unanswered: EndpointDown out of run (an EngineUnavailable,
    which the replica runner does not turn into error records: the job stops, rows kept for
    resume)."""
    from prefixflow.engine.outputs import EngineUnavailable
    from prefixflow.pipeline import build_plan

    import numpy as np
    import pyarrow as pa

    import prefixflow
    from prefixflow.operators.stages.generate import group_outputs

    plan = build_plan([[1, 2, 3], [4, 5, 6]], row_ids=[0, 1])
    with ScriptedServer([(503, "down", {})] * 8, get_script=[(503, "down", {})] * 4) as server:
        settings = {"endpoints": [server.url], "max_retries": 1, "backoff_s": 0.01, "max_concurrency": 1}
        engine = HttpEngine(EngineConfig(model=str(tiny_model), device="cpu"), HttpConfig.of(settings))
        with pytest.raises(EngineUnavailable, match="HTTP 503: down"):
            list(engine.run(plan.groups(0), SamplingParams(max_tokens=1)))
        # through the replica runner's isolation of failing rows: no row becomes an error record
        config = prefixflow.ProcessorConfig(model=str(tiny_model), engine={"backend": "http", "http": settings})
        outs = []
        with pytest.raises(EngineUnavailable):
            for out in group_outputs(engine, config, plan.groups(0), pa.table({"q": ["x", "y"]}), np.arange(2)):
                outs.append(out)
        assert outs == []
        engine.close()


def test_vllms_sampling_fields_are_sent_only_where_a_row_sets_them():
    plain = completion_body(MODEL, [1, 2], SamplingParams(temperature=0.5, max_tokens=3), token_ids=False)
    assert plain == {"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "temperature": 0.5, "top_p": 1.0, "n": 1}
    full = completion_body(
        MODEL,
        [1],
        SamplingParams(top_k=5, min_tokens=2, stop=("\n",), ignore_eos=True, seed=3, logprobs=2),
        token_ids=True,
    )
    assert {k: full[k] for k in ("top_k", "min_tokens", "stop", "ignore_eos", "seed", "logprobs")} == {
        "top_k": 5,
        "min_tokens": 2,
        "stop": ["\n"],
        "ignore_eos": True,
        "seed": 3,
        "logprobs": 2,
    }
    assert full["return_tokens_as_token_ids"] is True and full["return_token_ids"] is True
