"""Issue 27, classes 5 and 8: specs and templates that bomb, and inputs that were quietly changed.

- A YAML alias bomb (anchors of lists of aliases) is refused while it is parsed, by the number
  of values it expands to, as one SpecError line naming the field; legitimate anchors, aliases
  and merge keys still work. The spec file and `--set` values have a size cap.
- A prompt template that would build a huge value, loop for ever or recurse becomes a RowError
  for its row (an error record; `validate` reports it), never an OverflowError or MemoryError
  traceback or a render that runs for ages. Normal templates render exactly as Jinja does.
- A chat message with an image (where the job takes none) or any other non-text content part
  is that row's error, not a request answered from its text; a positive temperature below
  vLLM's floor is refused.

Hypothesis cases are bounded (25 to 40 examples each: 65 generated hostile inputs, 30 normal
templates); the file takes about half a minute, most of it the one whole job on the local Ray.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import StrictUndefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixflow.jobs.spec import SpecError, load_spec, load_yaml, parse_overrides, parse_spec
from prefixflow.operators.columns import ERROR
from prefixflow.operators.stages.openai_batch import parse_requests
from prefixflow.operators.stages.read import parse_jsonl
from prefixflow.operators.template import PromptTemplate, RowError, messages_from_value
from prefixflow.requests import SamplingParams

HOSTILE = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# --- class 8: YAML resource bombs --------------------------------------------------------------


def _bomb(levels: int, indent: str = "", width: int = 9) -> str:
    """Billion laughs: level 0 is `width` strings, each level `width` aliases of the one before."""
    lines = [f"{indent}l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _spec_text(tail: str = "") -> str:
    return "model: /m\ninput: {path: in.jsonl}\nprompt: {template: 'Q: {{ q }}'}\noutput: {path: out}\n" + tail


@pytest.mark.parametrize("levels", [9, 10])
def test_alias_bomb_in_a_spec_is_refused_naming_the_field(tmp_path, levels):
    # Under engine.vllm (a free-form mapping) the old loader expanded it: 9 levels took 31.6 s
    # and 1.7 GB before any refusal; 10 levels about 17 GB.
    text = _spec_text("engine:\n  backend: vllm\n  vllm:\n" + _bomb(levels, indent="    "))
    assert len(text.encode()) < 1200
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert len(e.value.problems) == 1, e.value.problems
    field, message = e.value.problems[0]
    assert field.startswith("engine.vllm.l"), field
    assert "expands to more than" in message and "aliases" in message, message
    assert "\n" not in str(e.value)


def test_alias_bomb_in_a_set_value_is_refused():
    flow = "{" + _bomb(8).replace("\n", ", ").rstrip(", ") + "}"
    with pytest.raises(SpecError) as e:
        parse_overrides([f"engine.vllm={flow}"])
    ((field, message),) = e.value.problems
    assert e.value.source == "--set" and field.startswith("engine.vllm.l") and "expands to" in message


def test_recursive_and_deep_aliases_are_refused():
    with pytest.raises(SpecError, match="refers to itself"):
        load_yaml("sampling: {stop: &s [a, *s]}\n", "s.yaml")
    # Each anchor is shallow where it is written, but aliases stack the levels up.
    deep = "a0: &a0 [[[[[[[[x]]]]]]]]\n" + "".join(f"a{i}: &a{i} [[[[[[[[*a{i - 1}]]]]]]]]\n" for i in range(1, 6))
    with pytest.raises(SpecError, match="nested more than 32 levels") as e:
        load_yaml(deep, "s.yaml")
    assert e.value.problems[0][0].startswith("a")


def test_anchors_aliases_and_merge_keys_still_work(tmp_path):
    data = load_yaml("base: &b {x: 1, y: [1, 2]}\nmore: {<<: *b, y: 3}\nboth: [*b, *b]\n", "s")
    assert data == {"base": {"x": 1, "y": [1, 2]}, "more": {"x": 1, "y": 3}, "both": [{"x": 1, "y": [1, 2]}] * 2}
    path = tmp_path / "job.yaml"
    path.write_text(
        "model: /m\ninput: {path: &p in.jsonl}\nname: *p\n"
        "prompt: {template: 'Q: {{ q }}'}\noutput: {path: out}\n"
        'sampling: &s {stop: &stops ["\\n\\n", END], max_tokens: 8}\n'
        "score: null\n"
    )
    spec = load_spec(path)
    assert spec.name == "in.jsonl" and spec.sampling.stop == ("\n\n", "END")
    # A wide spec without aliases is nowhere near the bound: 20,000 stop strings.
    many = ", ".join(f"s{i}" for i in range(20_000))
    assert len(load_yaml(f"stop: [{many}]\n", "s")["stop"]) == 20_000


def test_spec_file_and_set_values_have_a_size_cap(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(_spec_text("name: '" + "x" * (2 << 20) + "'\n"))
    with pytest.raises(SpecError, match="bytes") as e:
        load_spec(path)
    assert "MiB" in str(e.value)
    with pytest.raises(SpecError, match="bytes") as e:
        parse_overrides(["prompt.template=" + "x" * 200_000])
    assert e.value.problems[0][0] == "prompt.template"
    assert parse_overrides(['prompt.template="Q: {{ q }}"']) == {"prompt.template": "Q: {{ q }}"}


@st.composite
def alias_bombs(draw: st.DrawFn) -> str:
    """A bomb of random shape: widths and depths whose product passes the bound, as block or
    flow YAML, under a random field, sometimes with mappings instead of lists."""
    width = draw(st.integers(4, 12))
    levels = 1
    while width**levels <= 200_000:
        levels += 1
    levels += draw(st.integers(0, 2))
    as_maps = draw(st.booleans())
    lines = []
    for i in range(levels):
        items = [f"s{j}" for j in range(width)] if i == 0 else [f"*l{i - 1}"] * width
        body = ", ".join(f"k{j}: {v}" for j, v in enumerate(items)) if as_maps else ", ".join(items)
        lines.append(f"l{i}: &l{i} " + ("{" + body + "}" if as_maps else "[" + body + "]"))
    where = draw(st.sampled_from(["", "engine:\n  vllm:\n", "x:\n"]))
    indent = "    " if where.startswith("engine") else ("  " if where else "")
    return where + "".join(indent + line + "\n" for line in lines)


@HOSTILE
@given(alias_bombs())
def test_generated_alias_bombs_are_spec_errors(text):
    with pytest.raises(SpecError) as e:
        parse_spec(load_yaml(_spec_text(text), "gen.yaml"), "gen.yaml")
    assert "expands to more than" in str(e.value)


# --- class 8: templates that bomb ---------------------------------------------------------------

BOMBS = [
    "{{ range(10**9) | list }}",
    "{{ 'a' * 10**12 }}",
    "{{ [1, 2] * 10**11 }}",
    "{{ 10 ** (10 ** 10) }}",  # Jinja's ** groups left: 10 ** 10 ** 10 is (10**10)**10, harmless
    "{{ 'x' | center(10**12) }}",
    "{{ 'x'.ljust(10**11) }}",
    "{{ q.rjust(10**10) }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ '%10000000000d' % 1 }}",
    "{{ '{:10000000000}'.format(1) }}",
    "{{ '{:{w}}'.format(1, w=10**10) }}",
    "{{ '%*d' | format(10**10, 1) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s | length }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    "{{ ns.s | length }}",
    "{% set ns = namespace(a=['lol'] * 10) %}{% for i in range(12) %}"
    "{% set ns.a = [ns.a, ns.a, ns.a, ns.a, ns.a, ns.a, ns.a, ns.a, ns.a, ns.a] %}{% endfor %}{{ ns.a }}",
    "{% set a0 = ['lol'] * 9 %}"
    + "".join(  # billion laughs, unrolled
        f"{{% set a{i} = [{', '.join([f'a{i - 1}'] * 9)}] %}}" for i in range(1, 10)
    )
    + "{{ a9 }}",
    "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{{ lipsum(10**7) }}",
    "{{ range(100000) | join('x' * 1000000) }}",
    "{{ ('a' * 1000000).replace('a', 'b' * 1000000) }}",
    "{{ (1).to_bytes(10**10, 'big') }}",
    "{{ 'x' | indent(10**10, true) }}",
    "{{ [1] | batch(10**10, 0) | list }}",
    "{{ [1] | slice(10**9) | list }}",
    "{% set s %}{% for i in range(99999) %}{{ 'y' * 9999999 }}{% endfor %}{% endset %}{{ s | length }}",
    "{% for x in [1] recursive %}{{ loop([1, 2]) }}{% endfor %}",
    "{{ 2.0 ** (10 ** 6) }}",
]


@pytest.mark.parametrize("source", BOMBS)
def test_template_bomb_is_a_row_error(source):
    with pytest.raises(RowError, match="exceeded a template limit"):
        PromptTemplate(template=source).render({"q": "question"})


def test_template_bombs_in_chat_prompts_and_validate_are_row_errors():
    from prefixflow.jobs.preflight import row_problems, row_report

    with pytest.raises(RowError, match="prompt.user exceeded a template limit"):
        PromptTemplate(user="{{ 'a' * 10**12 }}").render({"q": "x"})
    with pytest.raises(RowError, match="prompt.system exceeded a template limit"):
        PromptTemplate(system="{{ range(10**9) | list }}", user="{{ q }}").render({"q": "x"})
    spec = parse_spec(
        {
            "model": "/m",
            "input": {"path": "in.jsonl"},
            "output": {"path": "out"},
            "prompt": {"template": "{% if q == 'bomb' %}{{ 'x' | center(10**12) }}{% endif %}Q: {{ q }}"},
        }
    )
    rows = [{"q": "fine", ERROR: None}, {"q": "bomb", ERROR: None}]
    report = row_report(spec, rows)
    assert report.num_bad == 1 and "exceeded a template limit" in report.reasons[0], report
    assert row_problems(spec, rows) == []


def test_template_bomb_rows_become_error_records_in_the_tokenize_stage(tiny_model):
    from prefixflow.operators.config import TokenizeOptions
    from prefixflow.operators.stages.tokenize import Tokenize

    source = (
        "{% if q == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% elif q == 'pow' %}{{ 10 ** (10 ** 10) }}"
        "{% elif q == 'mul' %}{{ 'a' * 10**12 }}{% endif %}Q: {{ q }}"
    )
    tok = Tokenize(
        TokenizeOptions(
            model=str(tiny_model),
            prompt=PromptTemplate(template=source),
            max_model_len=256,
            sampling=SamplingParams(max_tokens=4),
        )
    )
    qs = ["hello", "loop", "pow", "mul", "bye"]
    table = tok(pa.table({"q": qs, ERROR: pa.nulls(len(qs), pa.string())}))
    errors = table.column(ERROR).to_pylist()
    assert errors[0] is None and errors[4] is None, errors
    assert all("prompt.template exceeded a template limit" in e for e in errors[1:4]), errors


def _reference(source: str, values: dict) -> str:
    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)
    return env.from_string(source).render(values)


NORMAL = [
    "Q: {{ q }}\nA:",
    "{% for d in docs %}[{{ loop.index }}/{{ loop.length }}] {{ d | trim }}{% if not loop.last %}\n"
    "{% endif %}{% endfor %}\n\nQuestion: {{ q }}",
    "{{ q ~ '?' ~ n }} {{ (n * 3) ** 2 }} {{ '%05.1f|%-4s|%*d' % (x, 'ab', 6, n) }} {{ n // 2 }}",
    "{{ '{:>8}|{:,}|{:{w}}'.format(q, 1234567, n, w=5) }} {{ '%s-%s' | format(q, n) }}",
    "{{ docs | join(', ') }} {{ docs | map('upper') | list }} {{ docs | batch(2) | list }}",
    "{{ q | center(20) }}|{{ q.ljust(12) }}|{{ q | indent(2, true) }}|{{ q.replace('a', 'A') }}",
    "{% set ns = namespace(total=0) %}{% for d in docs %}{% set ns.total = ns.total + d | length %}"
    "{% endfor %}{{ ns.total }} {{ [1, 2] + [3] }} {{ (1, 2) }} {{ {'k': q} }} {{ [q] * 3 }}",
    "{% macro item(x, i) %}<{{ i }}:{{ x }}>{% endmacro %}{% for d in docs %}{{ item(d, loop.index0) }}"
    "{% else %}none{% endfor %}",
    "{% set block %}{% for k, v in meta | dictsort %}{{ k }}={{ v }};{% endfor %}{% endset %}{{ block }}",
    "{% for t in tree recursive %}{{ t.name }}{% if t.kids %}({{ loop(t.kids) }}){% endif %}{% endfor %}",
    "{{ range(5) | list }} {{ range(2, 9, 3) | sum }} {{ docs | length }} {{ 'x' * 3 }}{{ 2 ** 10 }}"
    "{{ 10 ** 10 ** 10 }}",
    "{% for i in range(3) %}{% for j in range(2) %}{{ i }}{{ j }}{{ loop.cycle('a', 'b') }} {% endfor %}"
    "{% endfor %}{{ n is divisibleby 3 }} {{ x | round(1) }} {{ q | wordwrap(5) }}",
    "{% filter upper %}{{ q }} {{ docs | first }}{% endfilter %} {{ meta.a }} {{ meta['b'] }}",
    "{% autoescape true %}{{ ('<b>' | safe) ~ q ~ '<i>' }}{{ '<u>%s</u>' | safe | format(q) }}"
    "{% endautoescape %}{{ ('<b>' | safe).center(9) }} {{ ('x' | safe) * 2 }} "
    "{{ ('<i>{}</i>' | safe).format(q) }} {{ ('<i>' | safe) ~ '<b>' }}",
]
VALUES = {
    "q": "what is a banana",
    "n": 42,
    "x": 3.14159,
    "docs": ["  alpha ", "beta", "gamma"],
    "meta": {"a": 1, "b": "two"},
    "tree": [{"name": "r", "kids": [{"name": "c1", "kids": []}, {"name": "c2", "kids": []}]}],
}


@pytest.mark.parametrize("source", NORMAL)
def test_normal_templates_render_exactly_as_jinja_does(source):
    assert PromptTemplate(template=source).render(VALUES) == _reference(source, VALUES)


PIECES = [
    "{{ q }}",
    "{{ n * 3 }}{{ n // 2 }}{{ -n }}",
    "{{ q ~ n ~ xs }}",
    "{{ xs | join('-') }}",
    "{{ q | upper | center(n) }}",
    "{{ [n, q] }}{{ (n, n) }}{{ {'a': n, 'b': xs} }}",
    "{{ '%s=%d|%5.2f' % (q, n, n / 3) }}",
    "{{ '{}:{!r}:{:>6}'.format(q, n, q) }}",
    "{{ q.ljust(n) }}|{{ q.replace('a', 'AB') }}",
    "{{ xs * 2 }}{{ q * n }}",
    "{{ q + q }}{{ xs + [q] }}",
    "{{ n ** 3 }}{{ 2 ** n }}",
    "{{ range(n) | list }}{{ range(n) | sum }}",
    "{% for x in xs %}{{ loop.index }}:{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
    "{% if n > 7 %}big{% else %}small{% endif %}",
    "{{ xs | map('upper') | join }}{{ xs | length }}",
    "{% set ns = namespace(t='') %}{% for x in xs %}{% set ns.t = ns.t ~ x %}{% endfor %}{{ ns.t }}",
    "{% macro m(a) %}<{{ a }}>{% endmacro %}{{ m(q) }}{{ m(n) }}",
    "{{ xs | batch(2) | list }}",
    "{{ q | wordwrap(4) | indent(2) }}",
    "{{ q | format if '%' not in q else q }}",
]


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=4),
    st.fixed_dictionaries(
        {"q": st.text(max_size=12), "n": st.integers(0, 20), "xs": st.lists(st.text(max_size=5), max_size=4)}
    ),
)
def test_generated_normal_templates_render_as_jinja_does(pieces, values):
    source = "Q " + " ".join(pieces)
    try:
        expected = _reference(source, values)
    except Exception:  # noqa: BLE001 - e.g. a TypeError for this row: ours makes it the row's error
        with pytest.raises(RowError):
            PromptTemplate(template=source).render(values)
        return
    assert PromptTemplate(template=source).render(values) == expected


def test_limits_hold_at_compile_time_too():
    # Jinja folds constant filter calls while it compiles: that must not build the value either.
    for source in ("{{ 'x' | center(100000000000) }}", "{{ '%100000000000d' % 1 }}"):
        template = PromptTemplate(template=source)  # compiles (spec validation) without building it
        with pytest.raises(RowError, match="exceeded a template limit"):
            template.render({})


def test_a_template_nested_too_deeply_is_a_spec_problem_not_a_recursion_error():
    deep = "{{ " + "(" * 3000 + "q" + ")" * 3000 + " }}"
    with pytest.raises(ValueError, match="nested too deeply"):
        PromptTemplate(template=deep)
    with pytest.raises(SpecError, match="prompt.template: .* nested too deeply"):
        parse_spec(
            {"model": "/m", "input": {"path": "in.jsonl"}, "output": {"path": "out"}, "prompt": {"template": deep}}
        )


HOSTILE_PARTS = {
    "repeat": lambda n: f"'ab' * {n}",
    "list_repeat": lambda n: f"[q, q] * {n}",
    "power": lambda n: f"7 ** {n}",
    "center": lambda n: f"q | center({n})",
    "indent": lambda n: f"q | indent({n}, true)",
    "ljust": lambda n: f"q.ljust({n})",
    "zfill": lambda n: f"q.zfill({n})",
    "expandtabs": lambda n: f"'\\t'.expandtabs({n})",
    "percent_star": lambda n: f"'%*s' % ({n}, q)",
    "percent_width": lambda n: f"'%{n}s' % q",
    "format_width": lambda n: "'{:" + str(n) + "}'.format(q)",
    "format_nested": lambda n: "'{:{w}}'.format(q, w=" + str(n) + ")",
    "format_filter": lambda n: f"'%{n}d' | format(1)",
    "range": lambda n: f"range({n}) | list",
    "lipsum": lambda n: f"lipsum({n})",
    "join_sep": lambda n: f"range(1000) | join('-' * {n // 1000 + 1})",
    "batch_fill": lambda n: f"[1] | batch({n}, 0) | list",
    "to_bytes": lambda n: f"(1).to_bytes({n}, 'big')",
}
WRAPS = [
    "{{{{ {} }}}}",
    "{{% set v = {} %}}{{{{ v | length }}}}",
    "{{% macro m() %}}{{{{ {} }}}}{{% endmacro %}}Q: {{{{ m() }}}}",
    "{{% for i in [1] %}}{{{{ {} }}}}{{% endfor %}}",
    "{{% if q %}}{{{{ ({}) | string }}}}{{% endif %}}",
]


@st.composite
def hostile_templates(draw: st.DrawFn) -> str:
    """One bomb (a size past the limits) inside one of a few constructs, or a loop bomb."""
    kind = draw(st.sampled_from(sorted(HOSTILE_PARTS) + ["loops", "doubling", "nesting"]))
    if kind == "loops":
        a, b = draw(st.integers(1001, 100000)), draw(st.integers(1001, 100000))
        return f"{{% for i in range({a}) %}}{{% for j in range({b}) %}}{{% endfor %}}{{% endfor %}}"
    if kind == "doubling":
        op = draw(st.sampled_from(["~", "+"]))
        return (
            "{% set ns = namespace(s=q) %}{% for i in range("
            + str(draw(st.integers(40, 90)))
            + f") %}}{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}{{{{ ns.s | length }}}}"
        )
    if kind == "nesting":
        width = draw(st.integers(3, 12))
        return (
            "{% set ns = namespace(a=[q]) %}{% for i in range("
            + str(draw(st.integers(30, 60)))
            + ") %}{% set ns.a = ("
            + ", ".join(["ns.a"] * width)
            + ") %}{% endfor %}{{ ns.a | length }}"
        )
    n = draw(st.integers(10**7 + 1, 10**13)) if kind != "power" else draw(st.integers(10**5, 10**12))
    return draw(st.sampled_from(WRAPS)).format(HOSTILE_PARTS[kind](n))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_templates(), st.sampled_from(["template", "user"]))
def test_generated_hostile_templates_are_row_errors(source, field):
    with pytest.raises(RowError, match="exceeded a template limit"):
        PromptTemplate(**{field: source}).render({"q": "a question"})


# --- class 5a: non-text content parts -----------------------------------------------------------

NON_TEXT = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f1"}},
]


@pytest.mark.parametrize("part", NON_TEXT, ids=lambda p: p["type"])
def test_messages_with_a_non_text_part_are_row_errors(part):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
    ]
    with pytest.raises(
        RowError, match=f"message 1 has a content part of type '{part['type']}': this model takes text only; remove it"
    ):
        messages_from_value(messages, "messages")
    with pytest.raises(RowError, match="message 1 has a content part"):
        PromptTemplate(messages_column="m").render({"m": json.dumps(messages)})


def test_text_parts_still_make_the_message():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert messages_from_value(messages, "m") == [{"role": "user", "content": "Hello there"}]
    with pytest.raises(RowError, match="message 0 has a content part that is not"):
        messages_from_value([{"role": "user", "content": ["just a string"]}], "m")


def test_openai_chat_request_with_an_audio_part_is_an_error_record():
    """An audio part is refused as the request is read; an image part passes the reader and is
    the tokenize stage's to take (a vision-language job) or refuse (tests/cpu/test_images.py)."""

    def line(cid: str, content: object) -> bytes:
        return json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": content}]},
            }
        ).encode()

    rows = parse_requests(
        parse_jsonl(
            b"\n".join(
                [
                    line("img", [{"type": "text", "text": "Describe"}, NON_TEXT[0]]),
                    line("audio", [{"type": "text", "text": "Describe"}, NON_TEXT[1]]),
                    line("txt", [{"type": "text", "text": "Describe"}]),
                    line("plain", "Describe"),
                ]
            ),
            "b.jsonl",
        )
    )
    by_id = {r["custom_id"]: r for r in rows}
    error = by_id["audio"][ERROR]
    assert "message 0 has a content part of type 'input_audio': this model takes text only" in error
    assert by_id["img"][ERROR] is None and by_id["txt"][ERROR] is None and by_id["plain"][ERROR] is None


# --- class 5b: temperatures below the floor -----------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-6, 0.0099])
def test_tiny_positive_temperature_is_refused_everywhere(temperature):
    fix = "use 0 for greedy decoding or at least 0.01"
    with pytest.raises(ValueError, match=f"SamplingParams.temperature={temperature!r} is invalid: {fix}"):
        SamplingParams(temperature=temperature)
    with pytest.raises(SpecError) as e:
        parse_spec(
            {
                "model": "/m",
                "input": {"path": "in.jsonl"},
                "prompt": {"template": "{{ q }}"},
                "output": {"path": "out"},
                "sampling": {"temperature": temperature},
            }
        )
    assert e.value.problems == [("sampling.temperature", f"{temperature!r} is invalid: {fix}")]
    from prefixflow.operators.stages.tokenize import check_row_sampling

    with pytest.raises(RowError, match=f"temperature={temperature!r} is invalid: {fix}"):
        check_row_sampling(SamplingParams(), {"sampling_params": {"temperature": temperature}})
    rows = parse_requests(
        [{"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "hi", "temperature": temperature}}]
    )
    assert fix in rows[0][ERROR]


def test_zero_and_the_floor_and_above_are_accepted():
    for t in (0, 0.0, 0.01, 0.05, 0.7, 1.5):
        assert SamplingParams(temperature=t).temperature == float(t)


# A whole job with rows that bomb the template and a tiny temperature: tests/cpu/test_bad_rows.py
# (test_job_with_bad_values_and_clashing_columns_finishes), one job with the other bad rows.
