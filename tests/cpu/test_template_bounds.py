"""Issue 43, items 9-11: every template, the model's chat template included, renders in one
bounded sandbox (prefixflow/sandbox.py): limits are checked before a value is built, the time
limit holds inside filters, and tokenize actors cap their memory.

- A chat template with two nested loops of 100,000 (before: the tokenize stage hung) is that
  row's error record, through our tokenizer, through transformers' and for a config's own
  chat_template; chat templates still render exactly as transformers renders them.
- `('a' * 500000) | wordwrap(1)` (before: 7 s per row, no error) is refused at once, and a
  render whose time goes into one filter call stops at the time limit.
- expandtabs, translate, join, tojson's indent, pprint, urlize and others are refused before
  they build (tracemalloc's peak stays small); before, they built their value first.
- Templates generated from the filter list and the str methods, with hostile and normal
  arguments: each renders within the limits or is a clear row error, never another exception.

No Ray; the whole file takes about 15 s.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import resource
import shutil
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixflow.operators.columns import ERROR
from prefixflow.operators.config import TokenizeOptions
from prefixflow.operators.stages.tokenize import Tokenize
from prefixflow.operators.template import PromptTemplate, RowError
from prefixflow.tokenizer import load_tokenizer

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _model_with_chat_template(tiny_model: Path, root: Path, template: str, transformers: bool = False) -> Path:
    folder = root / ("hf" if transformers else "fast")
    shutil.copytree(tiny_model, folder)
    (folder / "chat_template.jinja").write_text(template)
    if transformers:  # a key transformers rebuilds the tokenizer for: load_tokenizer takes its class
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_prefix_space": False}))
    return folder


def _chat_rows(tok: Tokenize, contents: list[str]) -> list[str | None]:
    messages = [json.dumps([{"role": "user", "content": c}]) for c in contents]
    table = tok(pa.table({"messages": messages, ERROR: pa.nulls(len(messages), pa.string())}))
    return table.column(ERROR).to_pylist()


# --- item 9: the model's chat template is bounded like any other ------------------------------


@pytest.mark.timeout(120)  # before: the loops ran for hours
@pytest.mark.parametrize("transformers", [False, True], ids=["tokenizer.json", "transformers"])
def test_a_chat_template_that_loops_for_ever_is_a_row_error(tiny_model, tmp_path, transformers):
    template = "{% if messages[0]['content'] == 'loop' %}" + LOOPS + "{% endif %}" + CHAT
    folder = _model_with_chat_template(tiny_model, tmp_path, template, transformers)
    tok = Tokenize(TokenizeOptions(model=str(folder), prompt=None, max_model_len=256))
    assert (type(tok.tokenizer).__module__.startswith("transformers")) == transformers
    errors = _chat_rows(tok, ["hello", "loop", "bye"])
    assert errors[0] is None and errors[2] is None, errors
    assert errors[1].startswith(
        "the chat template exceeded a template limit for this row: more than 250,000 loop iterations"
    ), errors


@pytest.mark.timeout(120)
def test_a_configs_own_chat_template_is_bounded_too(tiny_model):
    """ProcessorConfig.chat_template (Python API, map_batches, ray.data.llm's stages)."""
    tok = Tokenize(
        TokenizeOptions(
            model=str(tiny_model),
            prompt=None,
            max_model_len=256,
            chat_template=LOOPS + CHAT,
            chat_template_kwargs={"x": 1},
        )
    )
    assert "exceeded a template limit" in _chat_rows(tok, ["hi"])[0]
    tok = Tokenize(
        TokenizeOptions(
            model=str(tiny_model), prompt=None, max_model_len=256, chat_template="{{ raise_exception('x' * 5000) }}"
        )
    )
    error = _chat_rows(tok, ["hi"])[0]
    assert error.startswith("the chat template failed for this row: xxx") and len(error) < 600


def test_chat_templates_render_as_transformers_renders_them(tiny_model, tmp_path):
    """Through either tokenizer: tojson without HTML escaping, loop controls, {% generation %},
    trim_blocks and lstrip_blocks, special tokens as variables, extra variables, and
    continue_final_message (the last message left open)."""
    from transformers import AutoTokenizer

    from prefixflow.tokenizer import chat_text

    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
        "  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m | tojson }}{% endif %}|\n{% endfor %}{{ greeting | default('none') }}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    folder = _model_with_chat_template(tiny_model, tmp_path, template)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    chats = [
        [{"role": "user", "content": '<b>é & "x"</b>'}],
        [
            {"role": "system", "content": "s"},
            {"role": "skip", "content": "no"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "The answer is"},
        ],
    ]
    for messages in chats:
        for kwargs in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False, "greeting": "hi"},
            {"continue_final_message": True},
        ):
            try:
                expected = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
            except ValueError:  # the final message cannot be left open (tojson quoted it)
                for tokenizer in (ours, theirs):
                    with pytest.raises(ValueError, match="final message does not appear"):
                        chat_text(tokenizer, messages, **kwargs)
                continue
            assert chat_text(ours, messages, **kwargs) == expected
            assert chat_text(theirs, messages, **kwargs) == expected


# --- item 10: the time limit holds inside a filter -----------------------------------------------


def test_wordwrap_of_a_long_word_is_refused_before_it_runs():
    started = time.perf_counter()
    with pytest.raises(RowError, match="exceeded a template limit.*wordwrap filter would copy"):
        PromptTemplate(template="{{ ('a' * 500000) | wordwrap(1) }}").render({})
    assert time.perf_counter() - started < 60  # before: 7 s and no error; 1M characters: 63 s
    text = "a " * 1000 + "b" * 300
    assert PromptTemplate(template="{{ q | wordwrap(7) }}").render({"q": text}).count("\n") > 100


def test_a_render_stops_at_the_time_limit_inside_one_filter_call(monkeypatch):
    """`title` of 8M characters is one filter call of Python code (a few seconds): the clock
    stops it inside the call, not after."""
    import prefixflow.sandbox as sandbox

    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.05)
    with pytest.raises(RowError, match="rendering took more than 0.05 s"):
        PromptTemplate(template="{{ ('ab ' * 2600000) | title | length }}").render({})
    assert PromptTemplate(template="{{ q | title }}").render({"q": "a b"}) == "A B"


def test_the_time_limit_raises_only_inside_its_block():
    from prefixflow.deadline import TICK, TimeLimitExceeded, time_limit

    def busy(seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            n += 1
        return n

    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.1):
            busy(30)
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.1):
            try:
                busy(30)
            except TimeLimitExceeded:  # lost, as Python loses one raised in a gc callback
                pass
            busy(30)  # raised again
    with time_limit(0.1):  # left before the limit: nothing arrives later
        pass
    assert busy(3 * TICK + 0.1) > 0
    with time_limit(0.1):
        with time_limit(60):  # an inner block keeps the outer limit
            with pytest.raises(TimeLimitExceeded):
                busy(30)


# --- item 11: sizes are checked before a value is built ------------------------------------------

BUILDERS = {  # each would build 10-30 times MAX_TEXT (10M characters) from a small template
    "expandtabs": "{{ ('\\t' * 20000).expandtabs(10000) }}",
    "translate": "{{ ('ab' * 10000).translate({97: 'x' * 20000}) }}",
    "join_string": "{{ ('b' * 20000).join('a' * 10000) }}",
    "join_generator": "{{ ('x' * 20000).join(range(10000) | map('string')) }}",
    "join_filter_string": "{{ ('a' * 10000) | join('b' * 20000) }}",
    "join_filter_generator": "{{ range(10000) | map('string') | join('x' * 20000) }}",
    "tojson_indent": "{% set ns = namespace(v=[1] * 100) %}{% for i in range(5) %}{% set ns.v = [ns.v] %}"
    "{% endfor %}{{ ns.v | tojson(indent=200000) }}",
    "pprint_indent": "{{ {'a' * 100000: {'b' * 100000: {'c' * 100000: range(1000) | list}}} | pprint }}",
    "urlize_target": "{{ ('a.com ' * 2000) | urlize(target='x' * 100000) }}",
    "urlize_dots": "{{ ('.' * 10000 ~ 'x.') | urlize }}",  # before: 10 s in one regex call
    "list_of_chars": "{{ ('\u4e2d' * 2000000) | list | length }}",
    "big_ints_printed": "{{ [10 ** 3000] * 100000 }}",
    "split": "{{ ('a' * 9000000).split('a') | length }}",
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_value_past_the_limit_is_refused_before_it_is_built(name):
    tracemalloc.start()
    try:
        with pytest.raises(RowError, match="exceeded a template limit"):
            PromptTemplate(template=BUILDERS[name]).render({})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 60 << 20, f"{name}: {peak / 2**20:.0f} MiB built before the refusal"


def test_tokenize_workers_cap_their_memory(tiny_model):
    """In a process of its own (the cap is for good): the process of the tokenize stage's first
    batch refuses an allocation past its headroom with MemoryError; 1 GiB stands in for the
    8 GiB headroom."""
    code = (
        "import resource, sys\n"
        "import prefixflow.operators.stages.tokenize as t\n"
        "t.MEMORY_HEADROOM_BYTES = 1 << 30\n"
        "import pyarrow as pa\n"
        f"opts = t.TokenizeOptions(model={str(tiny_model)!r}, prompt=None, max_model_len=64)\n"
        "t.tokenize_batch(pa.table({'_pf_error': pa.array([], pa.string())}), opts)\n"
        "soft = resource.getrlimit(resource.RLIMIT_DATA)[0]\n"
        "assert soft != resource.RLIM_INFINITY, soft\n"
        "ok = bytearray(100 << 20)\n"
        "try:\n"
        "    bytearray(2 << 30)\n"
        "except MemoryError:\n"
        "    print('capped', soft)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("capped"), out.stderr[-2000:]


# --- the fuzz: templates built from the filter list and the str methods ----------------------------


def _parameters(func: Any) -> list[tuple[str, bool]]:
    """(name, may be given by keyword) of the parameters a template passes to a filter or an
    unbound str method after its value (for a filter, past the context, environment or eval
    context Jinja passes first)."""
    func = getattr(func, "__wrapped__", func)
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return [("a", False), ("b", False)]
    skip = 2 if getattr(func, "jinja_pass_arg", None) else 1
    return [
        (p.name, p.kind == p.POSITIONAL_OR_KEYWORD)
        for p in params[skip:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _filters() -> dict[str, list[str]]:
    from prefixflow.sandbox import environment

    return {
        name: _parameters(f)
        for chat in (False, True)
        for name, f in environment(chat).filters.items()
        if not name.startswith("_pf_")
    }


FILTERS = _filters()
METHODS = {name: _parameters(getattr(str, name)) for name in dir(str) if not name.startswith("_")}
TEXTS = [
    "q",
    "big",
    "('a' * 100000)",
    "('\\t' * 1000)",
    "('. ' * 5000)",
    "('\u4e2d' * 1000)",
    "('a.com ' * 300)",
    "(xs | join(' '))",
    "('x-y ' * 2000)",
]
OTHERS = [
    "xs",
    "n",
    "d",
    "range(1000)",
    "(range(300) | map('string'))",
    "[q, xs, d]",
    "(10 ** 3000)",
    "(2.5)",
    "({'k' * 1000: [xs, xs]})",
]
ARGS = [
    "0",
    "1",
    "2",
    "7",
    "80",
    "1000",
    "100000",
    "10000001",
    "10 ** 9",
    "10 ** 12",
    "-1",
    "''",
    "'x'",
    "','",
    "'\\t'",
    "'x' * 1000",
    "'x' * 100000",
    "true",
    "false",
    "none",
    "[1, 2]",
    "['a'] * 1000",
    "{97: 'xx' * 500}",
    "q",
    "xs",
    "('a', 'b')",
    "'upper'",
    "'length'",
    "'%s%s'",
    "'{0}{0}'",
]
WRAPPERS = [
    "{{{{ {} }}}}",
    "{{% set v = {} %}}{{{{ v | string | length }}}}",
    "{{% for i in [1, 2] %}}{{{{ {} }}}}{{% endfor %}}",
    "{{% macro m() %}}{{{{ {} }}}}{{% endmacro %}}{{{{ m() ~ m() }}}}",
]
ROW = {
    "q": "what is a banana",
    "xs": ["  alpha ", "beta", "gamma"],
    "n": 42,
    "d": {"a": 1, "b": "two"},
    "big": "ab c\t" * 20000,
}


@st.composite
def _call(draw: st.DrawFn, params: list[tuple[str, bool]]) -> str:
    """Up to as many arguments as the callable takes, the last ones by keyword where they can be."""
    n = draw(st.integers(0, min(len(params), 3)))
    by_name = n - draw(st.integers(0, n))  # from here on, where all can be
    while by_name < n and not all(keyword for _, keyword in params[by_name:n]):
        by_name += 1
    values = [draw(st.sampled_from(ARGS)) for _ in range(n)]
    return ", ".join(v if i < by_name else f"{params[i][0]}={v}" for i, v in enumerate(values))


@st.composite
def generated_templates(draw: st.DrawFn) -> str:
    """A subject put through one to three filters (any value) or str methods (a text), with
    normal and hostile arguments, inside one of a few constructs."""
    expr = draw(st.sampled_from(TEXTS + OTHERS))
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 2)):
            name = draw(st.sampled_from(sorted(FILTERS)))
            expr = f"{expr} | {name}({draw(_call(FILTERS[name]))})"
        else:
            name = draw(st.sampled_from(sorted(METHODS)))
            expr = f"({expr} | string).{name}({draw(_call(METHODS[name]))})"
    return draw(st.sampled_from(WRAPPERS)).format(expr)


FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def chat_tokenize(tiny_model):
    return Tokenize(TokenizeOptions(model=str(tiny_model), prompt=None, max_model_len=1 << 30))


@contextlib.contextmanager
def _memory_cap(headroom: int) -> Iterator[None]:
    """This process may allocate at most `headroom` more until the block ends (the tokenize
    actors' own cap, lifted again after: a soft limit)."""
    from prefixflow.operators.stages.tokenize import cap_data_memory

    before = resource.getrlimit(resource.RLIMIT_DATA)
    cap_data_memory(headroom)
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def _within_limits(run: Callable[[], tuple[str | None, str | None]], what: str) -> str | None:
    """Run one case: its text (within MAX_TEXT) or its row error (clear and short). Under a
    memory cap far above what the limits let a render build, a value built past them shows as
    a MemoryError, which no case may meet."""
    from prefixflow.sandbox import MAX_TEXT

    with _memory_cap(1 << 30):
        text, error = run()
    if error is not None:
        assert error.startswith(what) and " for this row" in error and len(error) < 800, error
        assert "MemoryError" not in error, error
        return error
    assert text is not None and len(text) <= MAX_TEXT
    return None


@FUZZ
@given(generated_templates())
def test_generated_prompt_templates_render_within_limits_or_are_row_errors(monkeypatch_module, source):
    def run() -> tuple[str | None, str | None]:
        try:
            return PromptTemplate(template="Q " + source).render(ROW), None
        except RowError as e:
            return None, str(e)

    _within_limits(run, "prompt.template")


@FUZZ
@given(generated_templates())
def test_generated_chat_templates_render_within_limits_or_are_row_errors(chat_tokenize, monkeypatch_module, source):
    import dataclasses

    chat_tokenize.opts = dataclasses.replace(
        chat_tokenize.opts,
        chat_template="{% set q = messages[0]['content'] %}"
        "{% set xs = ['  alpha ', 'beta', 'gamma'] %}{% set n = 42 %}"
        "{% set d = {'a': 1, 'b': 'two'} %}{% set big = 'ab c\t' * 20000 %}" + source,
    )
    table = pa.table(
        {"messages": [json.dumps([{"role": "user", "content": ROW["q"]}])], ERROR: pa.nulls(1, pa.string())}
    )

    def run() -> tuple[str | None, str | None]:
        out = chat_tokenize(table)  # raises nothing: a failing chat is the row's error
        return "", out.column(ERROR)[0].as_py()

    error = _within_limits(run, "the chat template")
    assert error is None or "template" in error


@pytest.fixture(scope="module")
def monkeypatch_module():
    """A 1 s render limit for the fuzz (5 s in a job): a case that runs long still ends as
    its row's error, without making the file slow."""
    import prefixflow.sandbox as sandbox

    patch = pytest.MonkeyPatch()
    patch.setattr(sandbox, "MAX_RENDER_SECONDS", 1.0)
    yield
    patch.undo()
