"""The real corpus held to its own rules, and the measurement's bookkeeping.

The labels are data that others will measure the product against, so they are checked here
the cheap way: one entry per file, every quoted line really in its sample, every labelled value
in the line that decides it, every message's kind recomputed from its own numbers. These tests
assert nothing about how well the product does (that is `make bench BENCH=corpus`); only that
it answers every sample and that the comparison counts what it says it counts.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.corpus import (
    LOGS_DIR,
    MESSAGES_DIR,
    NO_OOM_READ,
    Comparison,
    CorpusError,
    LogLabel,
    MessageFamily,
    MessageLabel,
    Numbers,
    ProductAnswer,
    RootCause,
    RuleKind,
    compare_log,
    compare_message,
    load_log_labels,
    load_message_labels,
    run_diagnose,
    sample_lines,
    scores,
)

MESSAGES = load_message_labels()
LOGS = load_log_labels()
# Families whose messages print the allocator figures the fragmentation rule reads.
RULE_FAMILIES = frozenset(
    {MessageFamily.TORCH_CUDA, MessageFamily.TORCH_HIP, MessageFamily.TORCH_XPU}
)
GIB = 1024**3
# Beyond any device: a size bug in the program, not memory pressure (issue 11 s.3); the
# product's daemon.rules.device_oom.BEYOND_ANY_DEVICE_BYTES (twice the largest card sold, 288 GB).
ABSURD_REQUEST_BYTES = 512 * GIB


def rule_kind(numbers: Numbers, expandable_segments: bool) -> RuleKind:
    """Issue 11 section 3 in its order, on the printed figures alone (X request, F free,
    U reserved but unallocated); a figure the rule needs and the message lacks: unknown."""
    request = numbers.requested_bytes
    free = numbers.free_bytes
    stranded = numbers.reserved_unallocated_bytes
    if request is None:
        return RuleKind.UNKNOWN
    if request > ABSURD_REQUEST_BYTES:
        return RuleKind.NOT_OOM
    if numbers.total_bytes is not None and request > numbers.total_bytes:
        return RuleKind.TRUE_OOM
    if free is not None and free >= request:
        return RuleKind.UNKNOWN
    if stranded is not None and (
        stranded >= request or (free is not None and free + stranded >= request)
    ):
        return RuleKind.TRUE_OOM if expandable_segments else RuleKind.FRAGMENTATION
    if free is None or stranded is None:
        return RuleKind.UNKNOWN
    return RuleKind.TRUE_OOM


def _files(directory: Path) -> list[str]:
    return sorted(
        path.name for path in directory.iterdir() if path.name not in {"README.md", "labels.toml"}
    )


@pytest.mark.parametrize(
    ("directory", "labelled"),
    [
        (MESSAGES_DIR, [label.file for label in MESSAGES]),
        (LOGS_DIR, [label.file for label in LOGS]),
    ],
    ids=["oom", "logs"],
)
def test_every_sample_has_exactly_one_label_and_every_label_a_sample(
    directory: Path, labelled: list[str]
) -> None:
    duplicates = sorted({file for file in labelled if labelled.count(file) > 1})
    assert duplicates == []
    assert sorted(labelled) == _files(directory)


@pytest.mark.parametrize("label", MESSAGES, ids=lambda label: label.file[:3])
def test_message_line_is_a_whole_line_of_its_sample(label: MessageLabel) -> None:
    assert label.message_line in sample_lines(MESSAGES_DIR / label.file)


@pytest.mark.parametrize("label", LOGS, ids=lambda label: label.file[:3])
def test_every_quoted_line_is_a_whole_line_of_its_sample(label: LogLabel) -> None:
    lines = sample_lines(LOGS_DIR / label.file)
    missing = [key for key, line in label.quoted_lines().items() if line not in lines]
    assert missing == []


@pytest.mark.parametrize("label", LOGS, ids=lambda label: label.file[:3])
def test_each_log_field_comes_with_the_line_that_decides_it(label: LogLabel) -> None:
    pairs = {
        "rank": (label.rank, label.rank_line),
        "host": (label.host, label.host_line),
        "step": (label.step, label.step_line),
        "phase": (label.phase, label.phase_line),
    }
    unquoted = [
        field for field, (value, line) in pairs.items() if (value is None) != (line is None)
    ]
    assert unquoted == []
    absent = [
        field
        for field, (value, line) in pairs.items()
        if field != "phase" and value is not None and line is not None and str(value) not in line
    ]
    assert absent == []


@pytest.mark.parametrize("label", MESSAGES, ids=lambda label: label.file[:3])
def test_message_kind_follows_the_rule_from_its_own_numbers(label: MessageLabel) -> None:
    if label.family in RULE_FAMILIES:
        assert label.kind == rule_kind(label.numbers, label.expandable_segments)
        assert f"-> {label.kind}" in label.arithmetic
    else:
        # No stranded figure: the rule has nothing to read (XLA's async allocator prints the
        # driver's free and total, 125, but no reserved-unallocated bytes).
        assert label.kind in {RuleKind.NOT_TORCH, RuleKind.NOT_OOM}
        assert label.numbers.reserved_unallocated_bytes is None


@pytest.mark.parametrize("label", MESSAGES, ids=lambda label: label.file[:3])
def test_message_figures_are_plausible_byte_counts(label: MessageLabel) -> None:
    figures = [*vars(label.numbers).values(), label.allowed_bytes]
    assert all(figure is None or figure >= 0 for figure in figures)
    assert label.cut_top_lines is None or label.cut_top_lines >= 0


@pytest.mark.parametrize("label", [*MESSAGES, *LOGS], ids=lambda label: label.file[:12])
def test_source_is_a_url_with_an_optional_note(label: MessageLabel | LogLabel) -> None:
    url, _, rest = label.source.partition(" ")
    parts = urlsplit(url)
    assert (parts.scheme, bool(parts.netloc), bool(parts.path.strip("/"))) == ("https", True, True)
    assert rest == "" or re.fullmatch(r"\(.+\)", rest)


@pytest.mark.parametrize(
    ("numbers", "expandable", "kind"),
    [
        # a request bigger than the card is a true OOM even with the driver "free" above it
        (Numbers(3 * GIB, 2 * GIB, 4 * GIB, 0, 0), False, RuleKind.TRUE_OOM),
        (Numbers(2**61, 80 * GIB, 0, 0, 0), False, RuleKind.NOT_OOM),
        (Numbers(GIB, 80 * GIB, GIB, 0, 0), False, RuleKind.UNKNOWN),
        (Numbers(GIB, 80 * GIB, 0, 0, GIB), False, RuleKind.FRAGMENTATION),
        (Numbers(GIB, 80 * GIB, GIB // 2, 0, GIB // 2), False, RuleKind.FRAGMENTATION),
        (Numbers(GIB, 80 * GIB, GIB // 2, 0, GIB // 2), True, RuleKind.TRUE_OOM),
        (Numbers(GIB, 80 * GIB, GIB // 2, 0, GIB // 2 - 1), False, RuleKind.TRUE_OOM),
        (Numbers(GIB, 80 * GIB, None, 0, GIB), False, RuleKind.FRAGMENTATION),
        (Numbers(GIB, 80 * GIB, None, 0, 0), False, RuleKind.UNKNOWN),
        (Numbers(None, 80 * GIB, 0, 0, 0), False, RuleKind.UNKNOWN),
    ],
)
def test_rule_is_applied_in_the_issues_order(
    numbers: Numbers, expandable: bool, kind: RuleKind
) -> None:
    assert rule_kind(numbers, expandable) == kind


def test_loader_rejects_a_misspelt_key_and_a_mistyped_value(tmp_path: Path) -> None:
    entry = (
        '[[sample]]\nfile = "001-x.log"\nsource = "https://github.com/o/r/issues/1"\n'
        'launcher = "torchrun"\nframework = "f"\nroot_cause = "cuda_oom"\n'
        'root_cause_line = "l"\nnotes = ""\n'
    )
    (tmp_path / "labels.toml").write_text(entry + 'rank_lien = "l"\n')
    with pytest.raises(CorpusError, match="rank_lien"):
        load_log_labels(tmp_path)
    (tmp_path / "labels.toml").write_text(entry + 'rank = "3"\n')
    with pytest.raises(CorpusError, match="rank is not an integer"):
        load_log_labels(tmp_path)
    (tmp_path / "labels.toml").write_text(entry.replace("cuda_oom", "oom"))
    with pytest.raises(CorpusError, match="root_cause"):
        load_log_labels(tmp_path)
    (tmp_path / "labels.toml").write_text(entry)
    assert load_log_labels(tmp_path)[0].root_cause is RootCause.CUDA_OOM


def test_message_loader_reads_a_family_only_by_its_word(tmp_path: Path) -> None:
    entry = (
        '[[sample]]\nfile = "001-x.txt"\nsource = "https://github.com/o/r/issues/1"\n'
        'software = "vLLM"\nfamily = "kv_cache"\nmessage_line = "l"\n'
        'expandable_segments = false\nkind = "not_torch"\narithmetic = ""\nnotes = ""\n'
    )
    (tmp_path / "labels.toml").write_text(entry)
    assert load_message_labels(tmp_path)[0].family is MessageFamily.KV_CACHE
    (tmp_path / "labels.toml").write_text(entry.replace("kv_cache", "vllm"))
    with pytest.raises(CorpusError, match="family = 'vllm' is not one of its words"):
        load_message_labels(tmp_path)


@pytest.mark.parametrize(
    "path",
    [
        *(MESSAGES_DIR / label.file for label in MESSAGES),
        *(LOGS_DIR / label.file for label in LOGS),
    ],
    ids=lambda path: f"{path.parent.name}/{path.name[:3]}",
)
def test_product_answers_every_sample_with_a_readable_verdict(path: Path) -> None:
    answer = run_diagnose(path)
    assert (answer.exit_code, answer.error) == (0, None)
    assert answer.kind is not None


def _message(kind: RuleKind, **numbers: int) -> MessageLabel:
    return MessageLabel(
        file="m.txt",
        source="https://github.com/o/r/issues/1",
        software="",
        family=MessageFamily.TORCH_CUDA,
        message_line="",
        numbers=Numbers(**numbers),
        expandable_segments=False,
        kind=kind,
        arithmetic="",
        notes="",
    )


def _by_field(rows: tuple[Comparison, ...]) -> dict[str, Comparison]:
    return {row.field: row for row in rows}


def test_a_figure_the_label_leaves_out_agrees_only_when_the_product_says_nothing() -> None:
    label = _message(RuleKind.TRUE_OOM, requested_bytes=GIB)
    answer = ProductAnswer(
        exit_code=0,
        kind="workspace_spike",
        read_oom=True,
        numbers=Numbers(requested_bytes=GIB, free_bytes=0),
    )
    rows = _by_field(compare_message(label, answer))
    assert (rows["kind"].product, rows["kind"].agrees) == ("true_oom", True)
    assert rows["requested_bytes"].agrees
    assert rows["total_bytes"].agrees  # neither side has it
    assert not rows["free_bytes"].agrees  # a claim the text does not show
    summary = {score.field: score for score in scores(tuple(rows.values()))}
    assert (summary["free_bytes"].false_claims, summary["free_bytes"].labelled_total) == (1, 0)
    assert (summary["numbers"].agree, summary["numbers"].total) == (0, 1)


@pytest.mark.parametrize(
    ("label_kind", "product_kind", "read_oom", "agrees"),
    [
        (RuleKind.NOT_TORCH, "true_oom", True, True),
        (RuleKind.NOT_TORCH, "unknown", True, True),
        (RuleKind.NOT_TORCH, "unknown", False, False),  # the product read no OOM at all
        (RuleKind.NOT_TORCH, "fragmentation", True, False),
        (RuleKind.UNKNOWN, "unknown", False, False),
        (RuleKind.NOT_OOM, "host_ram", False, True),
        (RuleKind.TRUE_OOM, "cotenant", True, False),
    ],
)
def test_kind_is_compared_in_the_rules_words(
    label_kind: RuleKind, product_kind: str, read_oom: bool, agrees: bool
) -> None:
    answer = ProductAnswer(exit_code=0, kind=product_kind, read_oom=read_oom)
    row = _by_field(compare_message(_message(label_kind), answer))["kind"]
    assert row.agrees is agrees
    if not read_oom and product_kind == "unknown":
        assert row.product == NO_OOM_READ


def test_log_fields_are_compared_in_the_labels_words() -> None:
    label = LogLabel(
        file="l.log",
        source="https://github.com/o/r/issues/1",
        launcher="torchrun",
        framework="",
        root_cause=RootCause.GPU_FAULT,
        root_cause_line="",
        notes="",
        rank=3,
        rank_line="",
        phase="optimizer",
        phase_line="",
    )
    answer = ProductAnswer(
        exit_code=0,
        kind="hardware",
        rank=3,
        host="gpu7",
        step=None,
        phase="optimizer_step",
        root_cause="gpu_fault",
    )
    rows = _by_field(compare_log(label, answer))
    assert {field: row.agrees for field, row in rows.items()} == {
        "rank": True,
        "host": False,  # the label shows no host: the product's is a false claim
        "step": True,
        "phase": True,
        "root_cause": True,
    }
    assert rows["root_cause"].product == "gpu_fault"
