"""The importer on hostile input (issue 23): every reader ends, small, and never with a traceback.

The importer reads a user's script and configs inside a root daemon. Each input of
`tests.importer_corpus.HOSTILE_SCRIPTS` and `HOSTILE_CONFIGS` repeats the characters one of its
readers could take in more than one way (`[` and blanks for the TOML table expression, which
was cubic: 40 s at 6 KB; blanks in a YAML key; backslashes in strings; `&&` chains; `$(`...).
No test here measures time: each reads its input at 2 KB and 64 KB under `timeout(20)`, which
a quadratic or cubic reader at 64 KB overruns by far, and must return a result or raise
`ImporterError`, the importer's own error, nothing else. Memory is measured with tracemalloc,
which counts allocations, not time: a 64 KB input stays under `MAX_PEAK_BYTES` and its peak
grows at most linearly from 8 KB (the copies of a line per site held 280 MB at 64 KB).
Hypothesis fuzzes the same readers with text drawn from their ambiguous characters, and checks
what each promises: spans that cut the text where the value is, byte offsets that cut its
UTF-8 encoding the same way.
"""

from __future__ import annotations

import itertools
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.cli import main
from daemon.importer import Analysis, ImporterError, Knob, Status, analyse
from daemon.importer.configs import ConfigFormat, Entry, read_config, yaml_key
from daemon.importer.lexer import MAX_STATEMENT_PARTS, TokenKind, significant_tokens, tokenize
from daemon.importer.records import MAX_OCCURRENCES
from daemon.importer.shell import Chain, parse
from tests.importer_corpus import (
    AND_AND_SCRIPT,
    HEADER,
    HOSTILE_CONFIGS,
    HOSTILE_SCRIPTS,
    heredoc_script,
    toml_bracket_script,
)

SIZES = (2_048, 65_536)
MAX_PEAK_BYTES = 64 * 1024 * 1024  # for a 64 KB input: 1,000 bytes a character
_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _analysed(script: str, files: dict[str, str] | None = None) -> Analysis | None:
    """The analysis, or None when the importer refused the input with its own error."""
    try:
        return analyse(script, files=files)
    except ImporterError:
        return None


def _peak(read: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        read()
    except ImporterError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ---------------------------------------------------------------- worst inputs, explicit


@pytest.mark.timeout(20)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_each_config_reader_reads_its_worst_input(name: str, size: int) -> None:
    config_format, build = HOSTILE_CONFIGS[name]
    text = build(size)
    entries = read_config(text, config_format)
    _check_entries(text, entries)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(HOSTILE_SCRIPTS))
def test_each_hostile_script_is_analysed_or_refused(name: str, size: int) -> None:
    script = HOSTILE_SCRIPTS[name](size)
    analysis = _analysed(script)
    if analysis is not None:
        assert len(analysis.knobs) == len(Knob)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE_SCRIPTS))
def test_a_hostile_scripts_memory_is_small_and_grows_linearly(name: str) -> None:
    build = HOSTILE_SCRIPTS[name]
    small, large = _peak(lambda: analyse(build(8_192))), _peak(lambda: analyse(build(65_536)))
    assert large < MAX_PEAK_BYTES
    assert large <= 12 * small + 2 * 1024 * 1024  # 8 times the input: not 64 times the memory


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_a_hostile_configs_memory_is_small_and_grows_linearly(name: str) -> None:
    config_format, build = HOSTILE_CONFIGS[name]
    small = _peak(lambda: read_config(build(8_192), config_format))
    large = _peak(lambda: read_config(build(65_536), config_format))
    assert large < MAX_PEAK_BYTES
    assert large <= 12 * small + 2 * 1024 * 1024


# ---------------------------------------------------------------- the findings, one by one


@pytest.mark.timeout(20)
def test_the_toml_bracket_heredoc_is_read_and_its_flag_found() -> None:
    for size in (6_000, 65_536):
        analysis = analyse(toml_bracket_script(size))
        assert analysis.reading(Knob.MICRO_BATCH).value == "8"


def test_a_script_ending_in_and_and_is_analysed() -> None:
    analysis = analyse(AND_AND_SCRIPT)
    assert analysis.reading(Knob.MICRO_BATCH).value == "4"
    assert [launch.launcher for launch in analysis.launches] == ["torchrun"]
    (chain,) = parse(AND_AND_SCRIPT)
    assert isinstance(chain, Chain)
    assert chain.ops == ("&&",)
    assert len(chain.items) == 2


@pytest.mark.parametrize(
    "script",
    [
        "a &&",
        "a ||\n",
        "a |",
        "if true; then a && fi\n",
        "( a && )\n",
        "{ a || }\n",
        "while a &&; do b; done\n",
        "case x in x) a && ;; esac\n",
    ],
)
def test_an_operator_that_joins_nothing_is_dropped(script: str) -> None:
    for node in parse(script):
        if isinstance(node, Chain):
            assert len(node.ops) == len(node.items) - 1
    assert _analysed(HEADER + script + "\ntorchrun t.py --batch_size 2\n") is not None


def test_the_and_and_script_gives_a_report_through_the_cli(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(AND_AND_SCRIPT)
    result = CliRunner().invoke(
        main, ["template", "analyse", str(script), "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    document = json.loads(result.output)
    micro = next(knob for knob in document["knobs"] if knob["knob"] == "micro_batch")
    assert micro["value"] == "4"


@pytest.mark.timeout(20)
def test_the_toml_bracket_heredoc_gives_a_report_through_the_cli(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(toml_bracket_script(65_536))
    result = CliRunner().invoke(
        main, ["template", "analyse", str(script), "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    json.loads(result.output)


@pytest.mark.parametrize(
    "flag",
    ["9" * 5_000, "1_", "1__0", "٣"],
    ids=["5000-digits", "trailing-underscore", "double-underscore", "arabic-digit"],
)
def test_a_number_python_cannot_convert_is_an_invalid_value(flag: str) -> None:
    analysis = analyse(f"{HEADER}torchrun t.py --batch_size {flag}\n")
    assert analysis.reading(Knob.MICRO_BATCH).status is Status.INVALID


@pytest.mark.parametrize(
    "script",
    [
        "#SBATCH -N " + "1" * 5_000 + "\n#SBATCH --gpus=16\ntorchrun t.py\n",
        "#SBATCH --ntasks=" + "1" * 5_000 + "\n#SBATCH --gpus-per-task=1\ntorchrun t.py\n",
        "A=(a b)\nX=${A[" + "1" * 5_000 + "]}\ntorchrun t.py --batch_size $X\n",
        "srun --het-group=" + "1" * 5_000 + " torchrun t.py --batch_size 2\n",
        "[ " + "1" * 5_000 + " -eq 1 ] && X=1\ntorchrun t.py --batch_size $X\n",
    ],
    ids=["nodes", "tasks", "array-index", "het-group", "test"],
)
def test_huge_numbers_elsewhere_are_read_without_a_traceback(script: str) -> None:
    assert len(analyse(script).knobs) == len(Knob)


def test_a_lone_surrogate_is_refused_by_the_importers_own_error() -> None:
    with pytest.raises(ImporterError, match="no UTF-8 form"):
        analyse(f"{HEADER}torchrun t.py --batch_size \ud800\n")
    analysis = analyse("torchrun t.py --config c.yaml\n", files={"c.yaml": "batch_size: \ud800\n"})
    assert any("c.yaml: not read" in note for note in analysis.notes)


def test_a_knob_written_in_thousands_of_places_lists_a_few_and_says_so() -> None:
    analysis = analyse(HOSTILE_SCRIPTS["one-line-flags"](20_000))
    reading = analysis.reading(Knob.MICRO_BATCH)
    assert reading.value == "4"
    assert len(reading.occurrences) == MAX_OCCURRENCES
    assert reading.unlisted > 1_000
    assert "more places, not listed" in reading.reason


def test_a_command_of_too_many_parts_is_refused() -> None:
    with pytest.raises(ImporterError, match=str(MAX_STATEMENT_PARTS)):
        analyse(HOSTILE_SCRIPTS["one-line-flags"](1_000_000))


def test_references_that_copy_too_much_stay_opaque_with_a_note() -> None:
    analysis = analyse(HOSTILE_SCRIPTS["growing-value"](200_000))
    assert any("copy more text than the analysis reads" in note for note in analysis.notes)


def test_a_heredoc_after_a_semicolon_is_still_the_file_it_writes() -> None:
    """Commands are handed out as they are read, but not before their line's bodies."""
    script = (
        f"{HEADER}cat > c.yaml <<EOF; torchrun t.py --config c.yaml\n"
        "per_device_train_batch_size: 6\nEOF\n"
    )
    assert analyse(script).reading(Knob.MICRO_BATCH).value == "6"


def test_a_heredoc_in_a_function_is_written_when_the_function_runs() -> None:
    script = (
        f"{HEADER}write() {{\n  cat > ds.json <<EOF\n"
        '{"train_micro_batch_size_per_gpu": 3}\nEOF\n}\n'
        + "echo padding\n" * 50
        + "write\ntorchrun t.py --deepspeed ds.json\n"
    )
    assert analyse(script).reading(Knob.MICRO_BATCH).value == "3"


@pytest.mark.timeout(20)
def test_interpolations_that_double_at_each_hop_are_read_once() -> None:
    body = "a0: 1\n" + "".join(f"a{i + 1}: ${{a{i}}}${{a{i}}}\n" for i in range(40))
    analysis = analyse(
        heredoc_script("c.yaml", body + "batch_size: ${a40}", "torchrun t.py --config c.yaml")
    )
    assert len(analysis.knobs) == len(Knob)


def test_yaml_keys_are_read_as_before() -> None:
    assert yaml_key("a b : c") == ("a b", 5)
    assert yaml_key("a:b: c") == ("a:b", 4)
    assert yaml_key("-x: 1") == ("-x", 3)
    assert yaml_key("'it''s': 1") == ("'it''s'", 8)
    assert yaml_key('"a\\"b" : 1') == ('"a\\"b"', 8)
    assert yaml_key("a # b: c") is None
    assert yaml_key("a" + " " * 10_000 + "x") is None
    assert yaml_key("- a: 1") is None


# ---------------------------------------------------------------- fuzz


def _check_entries(text: str, entries: list[Entry]) -> None:
    for entry in entries:
        assert 0 <= entry.start <= entry.value_start <= entry.value_end <= entry.end <= len(text)
        assert text[entry.value_start : entry.value_end] == entry.value


_CONFIG_CHARS = {
    ConfigFormat.TOML: "[]. \t\"'=a1#\n{}",
    ConfigFormat.YAML: "ab :#-'\"\\ \t[]{}|>\n",
    ConfigFormat.JSON: '[]{}",:\\ a1\n',
    ConfigFormat.PYTHON: "a =\"' #([\n1",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config_format", list(ConfigFormat))
def test_fuzzed_configs_are_read_with_true_spans(config_format: ConfigFormat) -> None:
    @_FUZZ
    @given(st.text(st.sampled_from(_CONFIG_CHARS[config_format]), max_size=400))
    def check(text: str) -> None:
        _check_entries(text, read_config(text, config_format))

    check()


_SHELL_PIECES = [
    "torchrun t.py",
    " --batch_size 4",
    " --batch_size=é2",
    "&&",
    "||",
    "|",
    ";",
    "&",
    "\n",
    " ",
    "if ",
    "then ",
    "fi",
    "case ",
    " in ",
    ")",
    "(",
    ";;",
    "esac",
    "for i in a; do ",
    "done",
    "{ ",
    " }",
    "f() ",
    "$(",
    "`",
    '"',
    "'",
    "${",
    "}",
    "$X",
    "X=",
    "X+=",
    "A=(",
    "<<EOF",
    "EOF",
    "<<-",
    "\\",
    "#",
    "#SBATCH -N 2\n",
    "export ",
    "eval ",
    "bash -c ",
    "${X:-",
    "${X:=",
    "$'",
    "[[ ",
    " == a* ]]",
    "ü",
    "\udcff",
    "cat > c.yaml <<EOF\nbatch_size: 4\n",
    " --config c.yaml",
]


@pytest.mark.timeout(120)
def test_fuzzed_scripts_are_analysed_with_true_sites() -> None:
    """Every site cuts the script (or a config) where its text is, by characters and by
    UTF-8 bytes alike (`surrogateescape`: bytes that are not UTF-8 count one each)."""

    @_FUZZ
    @given(st.lists(st.sampled_from(_SHELL_PIECES), max_size=40).map("".join))
    def check(script: str) -> None:
        files = {"c.yaml": "batch_size: 8\nx: ü\n"}
        analysis = _analysed(script, files)
        if analysis is None:
            return
        texts = {"job.sbatch": script, **files}
        for reading in analysis.knobs:
            for occurrence in reading.occurrences:
                for site in (occurrence.site, *occurrence.pieces):
                    if site is None or site.file not in texts:
                        continue
                    text = texts[site.file]
                    assert text[site.start : site.end] == site.text
                    encoded = text.encode("utf-8", "surrogateescape")
                    written = encoded[site.byte_start : site.byte_end]
                    assert written == site.text.encode("utf-8", "surrogateescape")

    check()


@pytest.mark.timeout(120)
def test_fuzzed_scripts_are_tokenized_losslessly_and_parsed_from_the_same_tokens() -> None:
    """The parser's stream (no blanks, comments, continuations; a run of newlines as one)
    holds the same words, operators and bodies as the lossless tokens, which cover the text."""
    kept = {TokenKind.WORD, TokenKind.OPERATOR, TokenKind.HEREDOC}

    @_FUZZ
    @given(st.lists(st.sampled_from(_SHELL_PIECES), max_size=60).map("".join))
    def check(script: str) -> None:
        try:
            tokens = tokenize(script)
            significant = list(significant_tokens(script))
            parse(script)
        except ImporterError:
            return
        assert "".join(script[token.start : token.end] for token in tokens) == script
        assert all(a.end == b.start for a, b in itertools.pairwise(tokens))
        assert [t for t in tokens if t.kind in kept] == [t for t in significant if t.kind in kept]

    check()


@pytest.mark.timeout(120)
def test_fuzzed_text_of_any_character_gives_a_result_or_the_importers_error() -> None:
    @_FUZZ
    @given(st.text(max_size=300), st.text(max_size=200))
    def check(script: str, config: str) -> None:
        for config_format in ConfigFormat:
            _check_entries(config, read_config(config, config_format))
        _analysed(script)
        _analysed(f"{HEADER}torchrun t.py --config c.yaml\n{script}", {"c.yaml": config})

    check()
