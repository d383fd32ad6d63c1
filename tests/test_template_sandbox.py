"""Rendering a user's template is bounded: a whitelist of Jinja constructs checked on the parsed
tree, an output cap, capped inputs, and every failure a `TemplateError` (issue 10, point 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.diagnosis import FailureKind
from daemon.planner import LineageHistory, PlannerPolicy, Proposal, Refusal, plan
from daemon.templates.model import TemplateError
from daemon.templates.reading import (
    MAX_CONFIG_BASE_DEPTH,
    MAX_VAR_CHARS,
    MAX_VAR_ITEMS,
    load_template,
    parse_template,
)
from daemon.templates.rendering import render
from daemon.templates.sandbox import MAX_CONCAT_OPERANDS, MAX_JINJA_TAGS, MAX_RENDERED_CHARS
from tests.test_planner import diagnosis
from tests.test_templates import SCRIPT, _document

EXAMPLES = Path(__file__).resolve().parent.parent / "launch_templates"
HEAD = "#!/bin/bash\n{{ sbatch_header }}\n"  # the construct under test sits on line 3


@pytest.mark.parametrize(
    ("construct", "named"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "a `for` loop",
        ),
        ('{% include "/etc/shadow" %}', "`include`"),
        ('{% import "x.j2" as x %}', "`import`"),
        ('{% extends "base.j2" %}', "`extends`"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "a macro"),
        ("{% call f() %}x{% endcall %}", "a `call` block"),
        ("{% set x = 1 %}", "`set`"),
        ("{{ 2**100000 }}", r"arithmetic \(`\*\*`\)"),
        ("{{ 'a'*10**9 }}", r"arithmetic \(`\*`\)"),
        ("{{ name + name }}", r"arithmetic \(`\+`\)"),
        ("{{ range(10) | shjoin }}", "a function or method call"),
        ("{{ lipsum() }}", "a function or method call"),
        ("{{ name.upper() | sh }}", "a function or method call"),
        ("{{ name | join }}", "the filter `join`"),
        ("{{ name | sh(1) }}", "arguments to `sh`"),
        ("{% if name is divisibleby 3 %}{% endif %}", "the test `divisibleby`"),
        ("{{ ['a'] | shjoin }}", "a list literal"),
        ("{{ vars.program[0:1] | shjoin }}", "a slice"),
        ("{{ name.__class__ | sh }}", "the attribute `__class__`"),
    ],
)
def test_constructs_outside_the_whitelist_are_refused_by_name_and_line(
    construct: str, named: str
) -> None:
    with pytest.raises(TemplateError, match=rf"line 3: {named} is not allowed"):
        parse_template(_document(), HEAD + construct + "\n")


def test_what_templates_use_renders() -> None:
    script = (
        HEAD + "{% if vars.program == 'train.py' and not knobs.seq_len %}A{% elif vars.program"
        " in name %}B{% else %}C{% endif %}\n"
        "{{ 'yes' if vars.flag is defined else 'no' }} {{ vars.program is none }}\n"
        "{{ (vars.program ~ '.log') | sh }} {{ vars.args[1] | sh }} {{ vars.args | shjoin }}\n"
        "{# a comment #}{% raw %}{{ kept }}{% endraw %}\n"
    )
    document = _document(vars={"program": "train.py", "args": ["--a", "b c"]})
    rendered = render(parse_template(document, script))
    assert rendered.splitlines()[-4:] == [
        "A",
        "no false",
        "train.py.log 'b c' --a 'b c'",
        "{{ kept }}",
    ]


def test_every_shipped_template_passes_the_whitelist_and_an_imported_one_never_meets_jinja() -> (
    None
):
    for directory in sorted(path.parent for path in EXAMPLES.glob("*/template.toml")):
        assert render(load_template(directory)).startswith("#!/bin/bash\n")
    sbatch = (Path(__file__).parent / "data" / "sbatch" / "hf_run_clm.sbatch").read_text()
    sbatch += 'echo "{% for i in range(10**9) %}{{ i }}{% endfor %}"\n'
    document = {"name": "clm", "dialect": "hf", "script": "job.sbatch", "imported": True}
    imported = parse_template(document, sbatch)
    assert render(imported) == sbatch  # the user's text is never a Jinja template
    knobs = {**imported.knobs, "per_device_train_batch_size": 8}
    assert render(imported, knobs) == sbatch.replace("batch_size 16 ", "batch_size 8 ")


def test_concatenation_is_short_and_flat() -> None:
    long = " ~ ".join(["name"] * (MAX_CONCAT_OPERANDS + 1))
    with pytest.raises(TemplateError, match="more than 4 operands"):
        parse_template(_document(), HEAD + f"\n{{{{ ({long}) | sh }}}}\n")
    with pytest.raises(TemplateError, match="or nested"):
        parse_template(_document(), HEAD + "\n{{ (name ~ (name ~ name) | sh) | sh }}\n")


def test_the_output_is_capped() -> None:
    value = "x" * (MAX_VAR_CHARS // 2)
    uses = MAX_RENDERED_CHARS // len(value) + 1
    script = HEAD + "{{ vars.big | sh }}\n" * uses
    with pytest.raises(TemplateError, match=f"over {MAX_RENDERED_CHARS} characters"):
        parse_template(_document(vars={"big": value}), script)


def test_too_many_tags_or_too_deep_an_expression_is_refused_before_it_runs() -> None:
    with pytest.raises(TemplateError, match=f"more than {MAX_JINJA_TAGS}"):
        parse_template(_document(), HEAD + "{{ name | sh }}" * (MAX_JINJA_TAGS + 1))
    with pytest.raises(TemplateError, match="nested too deeply"):
        parse_template(_document(), HEAD + "{{ " + "not " * 200 + "name }}\n")
    with pytest.raises(TemplateError):
        parse_template(_document(), HEAD + "{{ " + "(" * 5000 + "name" + ")" * 5000 + " }}\n")


@pytest.mark.parametrize(
    "expression",
    [
        "{{ vars.program < 1 }}",  # TypeError inside Jinja
        "{{ vars.program.nope | sh }}",  # undefined attribute
        "{{ knobs | sh }}",  # a dict is not a shell word
        "{{ vars.program[99] | sh }}",  # undefined item
        "{{ missing | sh }}",
        "{{ vars.line }}",  # unquoted, and it ends in a newline
    ],
)
def test_every_render_failure_is_a_template_error(expression: str) -> None:
    document = _document(vars={"program": "train.py", "line": "ok\n"})
    with pytest.raises(TemplateError):
        parse_template(document, HEAD + expression + "\n")


def test_a_var_ending_in_a_newline_cannot_pass_unquoted() -> None:
    """`$` would have matched before the newline and let it split the launch line."""
    document = _document(vars={"program": "train.py\nrm -rf ~"})
    with pytest.raises(TemplateError, match="unquoted value"):
        parse_template(document, SCRIPT.replace("vars.program | sh", "vars.program"))
    quoted = render(parse_template(document, SCRIPT))
    assert "srun 'train.py\nrm -rf ~'" in quoted


@pytest.mark.parametrize(
    ("vars_", "message"),
    [
        ({"big": "x" * (MAX_VAR_CHARS + 1)}, "at most"),
        ({"many": ["x"] * (MAX_VAR_ITEMS + 1)}, "at most"),
        ({"mixed": ["x", 1]}, "a string or a list of strings"),
    ],
)
def test_vars_are_bounded(vars_: dict[str, object], message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        parse_template(_document(vars={"program": "train.py", **vars_}), SCRIPT)


def test_config_base_is_bounded_in_depth_and_size() -> None:
    deep: dict[str, object] = {}
    node = deep
    for _ in range(MAX_CONFIG_BASE_DEPTH + 2):
        node["a"] = {}
        node = node["a"]  # type: ignore[assignment]
    with pytest.raises(TemplateError, match="nested deeper"):
        parse_template(_document(config_base=deep), SCRIPT)
    with pytest.raises(TemplateError, match="as JSON"):
        parse_template(_document(config_base={"k": "x" * 300_000}), SCRIPT)


def test_a_template_already_loaded_cannot_render_past_the_cap_with_new_values() -> None:
    template = load_template(EXAMPLES / "torchrun")
    huge = dict(template.variables) | {"program": ("x" * MAX_VAR_CHARS,) * 40}
    with pytest.raises(TemplateError, match="over"):
        render(dataclasses.replace(template, variables=tuple(huge.items())))


JINJA_PIECES = st.sampled_from(
    [
        "{{",
        "}}",
        "{%",
        "%}",
        " for x in y ",
        " endfor ",
        " if ",
        " endif ",
        " name ",
        " | sh ",
        " | shjoin ",
        " ** ",
        " * ",
        " ~ ",
        " ( ",
        " ) ",
        " [0] ",
        " .__class__ ",
        " 9" * 3,
        " include 'x' ",
        " macro m() ",
        " vars.program ",
        "\n",
        "#SBATCH --x\n",
        " {% raw %} ",
        " {% endraw %} ",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(JINJA_PIECES, max_size=30))
def test_any_jinja_like_text_renders_or_is_a_template_error(pieces: list[str]) -> None:
    try:
        template = parse_template(_document(), HEAD + "".join(pieces))
    except TemplateError:
        return  # the only failure a user's text may cause
    assert render(template).startswith("#!/bin/bash\n")


def test_the_planner_turns_a_template_that_stops_rendering_into_reasons() -> None:
    """A change that makes the user's script fail to render skips that rung; a script that does
    not render at all is a refusal, not a traceback in the daemon."""
    hf = load_template(EXAMPLES / "hf-trainer")
    trap = hf.script_source + (
        "{% if knobs.per_device_train_batch_size == 2 %}{{ missing | sh }}{% endif %}\n"
    )
    result = plan(
        diagnosis(FailureKind.TRUE_OOM),
        dataclasses.replace(hf, script_source=trap),
        LineageHistory(),
        PlannerPolicy(),
    )
    assert isinstance(result, Proposal)
    assert result.remediation.remediator != "micro_batch_down"
    skipped = {item.remediator: item.reason for item in result.skipped}
    assert skipped["micro_batch_down"].startswith("its change does not render:")
    broken = dataclasses.replace(hf, script_source=hf.script_source + "{{ missing | sh }}\n")
    refused = plan(diagnosis(FailureKind.TRUE_OOM), broken, LineageHistory(), PlannerPolicy())
    assert isinstance(refused, Refusal)
    assert refused.reason.startswith("the lineage's template does not render:")
