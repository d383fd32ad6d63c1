"""sdiag's DBD Agent queue size, on real outputs of Slurm 17.x to 26.05 collected from public
repositories and an issue thread (tests/data/slurm/sdiag/SOURCES.md says where each comes from).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import MAX_COUNT
from daemon.slurm.sdiag import MAX_SDIAG_TEXT, SDIAG_ARGV, parse_dbd_agent_queue

SAMPLES = Path(__file__).parent / "data" / "slurm" / "sdiag"

# What each sample shows; None where it has no DBD Agent queue size to give, so the parser
# must refuse it rather than guess.
EXPECTED: dict[str, int | None] = {
    "vpenso-2017-04.txt": None,  # before 17.11: no DBD line, only "Agent queue size:    0"
    "treydock-2020-06.txt": 0,
    "datadog-2024-09.txt": 0,  # a fixture with its blank lines taken out
    "sckyzo-24.11.7.txt": 0,
    "sckyzo-26.05.2.txt": 0,
    "rivosinc-23.02.4.json": 5,
    "rivosinc-24.05.5.json": 0,
    "rivosinc-issue-113-24.05.5-truncated.json": None,  # a paste cut after req_time_start
}


def _sample(name: str) -> str:
    return (SAMPLES / name).read_text(encoding="utf-8")


def test_every_sample_has_an_expectation() -> None:
    on_disk = {path.name for path in SAMPLES.iterdir() if path.name != "SOURCES.md"}
    assert on_disk == set(EXPECTED)


def test_every_sample_is_listed_in_sources() -> None:
    sources = _sample("SOURCES.md")
    for name in EXPECTED:
        assert f"`{name}`" in sources, name


# The local cluster's 22.05 (tests/data/slurm/README.md): idle, and 8 s after a job ended
# with slurmdbd stopped, its records still queued in slurmctld.
LOCAL = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38"


@pytest.mark.parametrize(
    ("name", "expected"), [("sdiag-idle.txt", 0), ("sdiag-slurmdbd-stopped.txt", 3)]
)
def test_local_capture(name: str, expected: int) -> None:
    assert parse_dbd_agent_queue((LOCAL / name).read_text(encoding="utf-8")) == expected


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_sample(name: str) -> None:
    expected = EXPECTED[name]
    if expected is None:
        with pytest.raises(SlurmParseError):
            parse_dbd_agent_queue(_sample(name))
    else:
        assert parse_dbd_agent_queue(_sample(name)) == expected


def test_argv_is_plain_sdiag() -> None:
    assert SDIAG_ARGV == ("sdiag",)


# --- the line and its neighbours -------------------------------------------------------------


def test_plain_agent_queue_line_is_not_the_dbd_one() -> None:
    text = "Server thread count:  3\nAgent queue size:     7\nAgent count:          0\n"
    with pytest.raises(SlurmParseError, match="no 'DBD Agent queue size:' line"):
        parse_dbd_agent_queue(text)


def test_the_dbd_value_not_the_agent_value() -> None:
    text = "Agent queue size:     7\nAgent count:          2\nDBD Agent queue size: 4\n"
    assert parse_dbd_agent_queue(text) == 4


def test_sample_without_its_dbd_line_is_refused() -> None:
    lines = _sample("treydock-2020-06.txt").splitlines(keepends=True)
    kept = "".join(line for line in lines if not line.startswith("DBD Agent queue size:"))
    assert "Agent queue size:     0" in kept
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(kept)


def test_paste_cut_before_the_dbd_line_is_refused() -> None:
    text = _sample("sckyzo-26.05.2.txt")
    cut = text[: text.index("DBD Agent")]
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(cut)


def test_label_must_start_the_line() -> None:
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue("Old DBD Agent queue size: 3\n")


def test_indented_line_and_crlf_are_read() -> None:
    assert parse_dbd_agent_queue("\tDBD Agent queue size:\t12\r\nJobs submitted: 1\r\n") == 12


@pytest.mark.parametrize("text", ["", "   \n\n", "Jobs submitted: 9706\n"])
def test_empty_or_unrelated_text_is_refused(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(text)


def test_same_value_twice_is_accepted() -> None:
    text = _sample("sckyzo-24.11.7.txt") + "DBD Agent queue size: 0\n"
    assert parse_dbd_agent_queue(text) == 0


def test_two_different_values_are_refused() -> None:
    text = _sample("sckyzo-24.11.7.txt") + "DBD Agent queue size: 9\n"
    with pytest.raises(SlurmParseError, match="twice"):
        parse_dbd_agent_queue(text)


@pytest.mark.parametrize(
    "value",
    [
        "-1",
        "+3",
        "",
        "N/A",
        "12abc",
        "1.5",
        "1e3",
        "0x10",
        "1 2",
        "\uff11\uff12",  # full-width digits: str.isdigit() says yes, sdiag never prints them
        "\u0663",  # ARABIC-INDIC DIGIT THREE
        str(MAX_COUNT + 1),
        "9" * 400,
    ],
)
def test_value_that_is_not_a_count_is_refused(value: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(f"Agent queue size:     0\nDBD Agent queue size: {value}\n")


def test_largest_count_is_read() -> None:
    assert parse_dbd_agent_queue(f"DBD Agent queue size: {MAX_COUNT}\n") == MAX_COUNT


def test_error_names_sdiag_and_keeps_a_short_excerpt() -> None:
    with pytest.raises(SlurmParseError) as caught:
        parse_dbd_agent_queue("DBD Agent queue size: " + "x" * 5000 + "\n")
    assert caught.value.source == "sdiag"
    assert len(caught.value.excerpt) <= 200


# --- size bound and linear time --------------------------------------------------------------


def test_text_over_one_mib_is_refused() -> None:
    text = _sample("treydock-2020-06.txt")
    padded = text + " " * (MAX_SDIAG_TEXT + 1 - len(text))
    assert len(padded) == MAX_SDIAG_TEXT + 1
    with pytest.raises(SlurmParseError, match="more than"):
        parse_dbd_agent_queue(padded)


def test_json_over_one_mib_is_refused() -> None:
    text = _sample("rivosinc-24.05.5.json")
    with pytest.raises(SlurmParseError, match="more than"):
        parse_dbd_agent_queue(text + " " * MAX_SDIAG_TEXT)


def test_text_of_exactly_one_mib_is_read() -> None:
    text = _sample("treydock-2020-06.txt")
    padded = text + "\n" * (MAX_SDIAG_TEXT - len(text))
    assert parse_dbd_agent_queue(padded) == 0


def test_many_near_miss_lines_are_read_in_one_pass() -> None:
    # A line of almost-label repeated until the bound: a backtracking matcher would crawl.
    line = "DBD Agent queue size " + " " * 40 + "\n"
    text = line * ((MAX_SDIAG_TEXT - 40) // len(line)) + "DBD Agent queue size: 1\n"
    assert parse_dbd_agent_queue(text) == 1


# --- sdiag --json ----------------------------------------------------------------------------


def _json(statistics: object, **extra: object) -> str:
    return json.dumps({"statistics": statistics, **extra})


def test_json_value_is_read() -> None:
    assert parse_dbd_agent_queue(_json({"agent_queue_size": 7, "dbd_agent_queue_size": 3})) == 3


def test_json_with_leading_whitespace_is_read_as_json() -> None:
    assert parse_dbd_agent_queue("\n  " + _json({"dbd_agent_queue_size": 0})) == 0


def test_json_agent_queue_alone_is_not_the_dbd_one() -> None:
    with pytest.raises(SlurmParseError, match="dbd_agent_queue_size"):
        parse_dbd_agent_queue(_json({"agent_queue_size": 7}))


@pytest.mark.parametrize(
    "value",
    [-1, "5", True, 1.0, None, [2], {"set": True, "infinite": False, "number": 2}, MAX_COUNT + 1],
)
def test_json_value_that_is_not_a_count_is_refused(value: object) -> None:
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(_json({"dbd_agent_queue_size": value}))


@pytest.mark.parametrize(
    "text",
    [
        "{",
        '{"statistics": []}',
        '{"meta": {}}',
        "[]",
        '{"statistics": {"dbd_agent_queue_size": 1}, "errors": [{"error": "x"}]}',
    ],
)
def test_json_without_a_usable_statistics_object_is_refused(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_dbd_agent_queue(text)


def test_json_key_twice_with_different_values_is_refused() -> None:
    text = '{"statistics": {"dbd_agent_queue_size": 0, "dbd_agent_queue_size": 9}}'
    with pytest.raises(SlurmParseError, match="twice"):
        parse_dbd_agent_queue(text)


def test_json_error_names_the_json_form() -> None:
    with pytest.raises(SlurmParseError) as caught:
        parse_dbd_agent_queue(_sample("rivosinc-issue-113-24.05.5-truncated.json"))
    assert caught.value.source == "sdiag --json"
