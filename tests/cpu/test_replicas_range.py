"""replicas as a range ({min, max}, ray.data.llm's concurrency=(min, max)) and work_stealing,
from the job spec and the Python API to what the job asks of the cluster."""

from __future__ import annotations

import pytest

from prefixflow.jobs.preflight import engine_slots, resource_problems
from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.config import ProcessorConfig


def _spec(tiny_model, **extra):
    return parse_spec(
        {
            "model": str(tiny_model),
            "input": {"path": "in.jsonl"},
            "output": {"path": "out"},
            "prompt": {"template": "{{ q }}"},
            **extra,
        }
    )


def test_a_range_plans_for_max_and_asks_the_cluster_for_min(tiny_model):
    config = _spec(tiny_model, replicas={"min": 2, "max": 4}).to_config()
    assert (config.replicas, config.min_replicas, config.work_stealing) == (4, 2, True)
    plain = _spec(tiny_model, replicas=3, work_stealing=False).to_config()
    assert (plain.replicas, plain.min_replicas, plain.work_stealing) == (3, None, False)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"min": 5, "max": 4}, "replicas: min=5 is more than max=4: give min <= max"),
        ({"min": 0, "max": 4}, "replicas.min: 0 is invalid: use a positive integer"),
        ({"max": 4}, "replicas.min: required field is missing"),
        ({"min": 1, "max": 2, "most": 3}, "replicas.most: unknown key (allowed: min, max)"),
        (True, "replicas: True is invalid: give a number, not true or false"),
        (0, "replicas: 0 is invalid: use a positive integer"),
    ],
)
def test_a_bad_replicas_value_names_the_field(tiny_model, bad, message):
    with pytest.raises(SpecError, match=None) as e:
        _spec(tiny_model, replicas=bad)
    assert message in str(e.value)


def test_min_replicas_is_checked_where_configs_are_built(tiny_model):
    with pytest.raises(ValueError, match="min_replicas=5 is invalid: use None or an integer from 1 to replicas"):
        ProcessorConfig(model=str(tiny_model), replicas=4, min_replicas=5)
    # Without stealing, a replica the cluster cannot hold would leave its partition waiting.
    with pytest.raises(ValueError, match="min_replicas=2 is invalid: a replicas range needs work_stealing=True"):
        ProcessorConfig(model=str(tiny_model), replicas=4, min_replicas=2, work_stealing=False)
    with pytest.raises(ValueError, match="a replicas range needs work_stealing=True"):
        _spec(tiny_model, replicas={"min": 2, "max": 4}, work_stealing=False).to_config()


def test_the_cluster_must_hold_min_engines_when_the_job_starts(tiny_model):
    spec = _spec(tiny_model, replicas={"min": 3, "max": 5})
    assert engine_slots([{"CPU": 4}, {"CPU": 1}], 1, 0) == 5
    assert engine_slots([{"CPU": 8, "GPU": 2}, {"CPU": 8}], 1, 1) == 2
    problems = resource_problems(spec, [{"CPU": 1}, {"CPU": 1}])
    assert problems == [
        (
            "replicas.min",
            "3 but the Ray cluster holds 2 engine(s) of 1 CPU(s) and 0 GPU(s) "
            "at once: lower replicas.min, or start the job on more nodes",
        )
    ]
    assert resource_problems(spec, [{"CPU": 2}, {"CPU": 1}]) == []
