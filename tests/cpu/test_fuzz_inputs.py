"""Hostile input: fuzzed job specs and rows never crash with anything but the documented
errors, never lose a good row, and nothing in a spec or a dataset can execute code.
Functions are fuzzed directly (no Ray), with small example counts to keep the suite fast."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixflow.jobs.spec import JobSpec, SpecError, load_spec, parse_spec
from prefixflow.operators.columns import ERROR
from prefixflow.operators.stages.read import parse_jsonl, rows_to_table
from prefixflow.operators.template import PromptTemplate, RowError

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8
)
keys = st.sampled_from(
    [
        "model",
        "input",
        "prompt",
        "sampling",
        "engine",
        "output",
        "replicas",
        "order",
        "storage",
        "max_retries_per_row",
        "name",
        "bogus",
    ]
)


@FAST
@given(st.dictionaries(keys, json_values, max_size=8))
def test_fuzzed_spec_is_valid_or_a_spec_error(data):
    try:
        spec = parse_spec(data)
    except SpecError as e:
        assert e.problems and all(isinstance(p, str) and isinstance(m, str) for p, m in e.problems)
        return
    assert isinstance(spec, JobSpec)


@FAST
@given(
    st.dictionaries(st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "n"]), json_scalars, max_size=4),
    st.dictionaries(st.sampled_from(["rows_per_part", "resume", "overwrite", "format"]), json_scalars, max_size=3),
)
def test_fuzzed_sections_name_the_field(sampling, output):
    data = {
        "model": "/m",
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "{{ q }}"},
        "sampling": sampling,
        "output": {"path": "out", **output},
    }
    try:
        parse_spec(data)
    except SpecError as e:
        assert all(p.split(".")[0] in ("sampling", "output") for p, _ in e.problems), e.problems


good_rows = st.lists(
    st.dictionaries(st.sampled_from(["q", "a", "id"]), json_scalars, min_size=1, max_size=3), max_size=8
)
junk_lines = st.lists(st.binary(max_size=30).filter(lambda b: b"\n" not in b), max_size=6)


@FAST
@given(good_rows, junk_lines, st.randoms(use_true_random=False))
def test_fuzzed_jsonl_keeps_every_good_row(rows, junk, rnd):
    lines = [json.dumps(r).encode() for r in rows]
    tagged = [(line, True) for line in lines] + [(j, False) for j in junk]
    rnd.shuffle(tagged)
    records = parse_jsonl(b"\n".join(line for line, _ in tagged), "f.jsonl")
    good = [r for r in records if r[ERROR] is None]
    # Every good row comes out, in order, with its values; nothing else is called good
    # unless the junk line happened to be a JSON object itself.
    want = [json.loads(line) for line, ok in tagged if ok or _is_object(line)]
    assert [{k: v for k, v in r.items() if not k.startswith("_pf_")} for r in good] == want
    assert len(records) >= len(rows)  # bad lines become error records, never vanish silently
    rows_to_table(records)  # any mix of types becomes a table


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
        return False


@FAST
@given(st.dictionaries(st.text(min_size=1, max_size=8), json_scalars, max_size=4), st.text(max_size=40))
def test_fuzzed_template_rendering_fails_only_with_row_errors(row, text):
    for tmpl in (
        PromptTemplate(template="{{ q }} " + text.replace("{", "(")),
        PromptTemplate(user="Q: {{ q }}", system=text.replace("{", "(")),
    ):
        try:
            out = tmpl.render(row)
        except RowError:
            continue
        assert out


# --- nothing executes code ------------------------------------------------------------------


def test_yaml_python_tags_are_rejected(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "model: !!python/object/apply:os.system ['echo pwned > %s']\n"
        "input: {path: in.jsonl}\noutput: {path: out}\n" % (tmp_path / "pwned")
    )
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(yaml.YAMLError):  # the loader itself refuses python/* tags
        yaml.safe_load("x: !!python/object:object {}")


@pytest.mark.parametrize(
    "attack",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ q.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set x = [] %}{{ x.append(1) }}",
    ],
)
def test_template_sandbox_blocks_code(attack):
    with pytest.raises(RowError):
        PromptTemplate(template=attack).render({"q": "hello"})


def test_row_values_are_data_not_templates():
    out = PromptTemplate(template="Q: {{ q }}").render({"q": "{{ ''.__class__.__mro__ }}"})
    assert out == "Q: {{ ''.__class__.__mro__ }}"  # rendered once, never re-evaluated


def test_trust_remote_code_is_off_unless_the_spec_turns_it_on():
    base = {"model": "/m", "input": {"path": "in.jsonl"}, "prompt": {"template": "{{ q }}"}, "output": {"path": "out"}}
    assert parse_spec(dict(base)).engine.trust_remote_code is False
    assert parse_spec({**base, "engine": {"trust_remote_code": True}}).engine.trust_remote_code is True


def test_fault_tolerance_options_are_validated():
    base = {
        "model": "/m",
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "{{ q }}"},
        "output": {"path": "out", "resume": True},
    }
    assert parse_spec(dict(base)).output.resume is True
    with pytest.raises(SpecError, match="max_retries_per_row"):
        parse_spec({**base, "max_retries_per_row": -1})
    with pytest.raises(SpecError, match="storage.max_attempts"):
        parse_spec({**base, "storage": {"max_attempts": 0}})
