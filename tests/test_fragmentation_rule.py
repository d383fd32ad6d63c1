"""The runbooks' fragmentation rule (issue 11 section 3) on real messages and on its edges.

With X the failed request, F the driver-free and U the reserved-but-unallocated bytes: X beyond
any device is a size bug (not_oom); X larger than the card is a true OOM no batch lever at the
same geometry may cure; F >= X is unknown; U >= X or F + U >= X is fragmentation, the margin
F + U - X setting only the confidence; otherwise a true OOM. With expandable segments already
on, stranded bytes are a full card (true OOM).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, History
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import Evidence, LogFindings, OomFamily, OomReport
from daemon.gather import template_expandable_segments
from daemon.rules.dispatch import diagnose
from daemon.templates.model import validate_knobs
from daemon.templates.reading import load_template
from tests.corpus import (
    KIND_AS_RULE,
    MESSAGES_DIR,
    MessageLabel,
    RuleKind,
    kind_agrees,
    load_message_labels,
)

LABELS = load_message_labels()
TEMPLATES = Path(__file__).resolve().parent.parent / "launch_templates"


def verdict_of(text: str, *, expandable: bool | None = None, **findings: object) -> Diagnosis:
    oom = parse_oom(text)
    assert oom is not None
    log = LogFindings(oom=oom, **findings)  # type: ignore[arg-type]
    return diagnose(Evidence(log=log, expandable_segments=expandable), History())


def new_format(requested: str, total: str, free: str, unallocated: str) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested}. GPU 0 has a"
        f" total capacity of {total} of which {free} is free. Including non-PyTorch memory, this"
        f" process has {total} memory in use. Of the allocated memory 60.00 GiB is allocated by"
        f" PyTorch, and {unallocated} is reserved by PyTorch but unallocated."
    )


def said(verdict: Diagnosis, words: str) -> bool:
    return any(words in reason for reason in verdict.reasons)


@pytest.mark.parametrize(
    "label",
    # 115 (held-out) is a poster's paraphrase, `CUDA out of the memory.`: not read yet
    [label for label in LABELS if label.family.startswith("torch_") and label.file[:3] != "115"],
    ids=lambda label: label.file[:3],
)
def test_each_real_pytorch_message_gets_its_labelled_kind(label: MessageLabel) -> None:
    verdict = verdict_of((MESSAGES_DIR / label.file).read_text(encoding="utf-8"))
    kind = KIND_AS_RULE.get(verdict.kind.value, verdict.kind.value)
    assert kind_agrees(label.kind, str(kind)), label.arithmetic


def test_unallocated_alone_covering_the_request_is_fragmentation_whatever_its_share() -> None:
    # 194.87 MiB stranded on a 79 GiB card (0.2%) covers a 22 MiB request: no share floor
    verdict = verdict_of(new_format("22.00 MiB", "79.15 GiB", "11.06 MiB", "194.87 MiB"))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.HIGH
    assert said(verdict, "194.87 MiB reserved but unallocated alone covers the 22.00 MiB request")
    assert said(verdict, "with 183.93 MiB to spare, 0.2% of the card")
    assert said(verdict, "set expandable_segments:True before any batch change")


def test_free_and_unallocated_together_covering_the_request_is_fragmentation() -> None:
    # real/oom/004: F = 3.71 GiB and U = 771.43 MiB against X = 4.22 GiB
    verdict = verdict_of(new_format("4.22 GiB", "15.69 GiB", "3.71 GiB", "771.43 MiB"))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.MEDIUM  # 249.19 MiB to spare: less than X again
    assert said(verdict, "3.71 GiB free and 771.43 MiB reserved but unallocated (4.46 GiB) cover")


def test_a_margin_within_the_printed_rounding_is_fragmentation_with_low_confidence() -> None:
    # F + U - X = 4 MiB, while three GiB figures each hide up to 5.12 MiB of rounding
    verdict = verdict_of(new_format("2.00 GiB", "79.15 GiB", "1.00 GiB", "1028.00 MiB"))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.LOW
    assert said(verdict, "within the rounding of the printed figures")


def test_short_of_the_request_is_a_true_oom_with_the_shortfall_said() -> None:
    verdict = verdict_of(new_format("2.00 GiB", "79.15 GiB", "1.00 GiB", "512.00 MiB"), step=0)
    assert verdict.kind is FailureKind.TRUE_OOM
    assert said(verdict, "fall 512.00 MiB short of the 2.00 GiB request: not fragmentation")


def test_free_covering_the_request_is_unknown_even_by_a_few_bytes() -> None:
    # real/oom/005: 41.56 MiB free against a 32 MiB request (the old 32 MiB margin said true OOM)
    verdict = verdict_of(new_format("32.00 MiB", "4.00 GiB", "41.56 MiB", "1.90 MiB"))
    assert verdict.kind is FailureKind.UNKNOWN
    assert said(verdict, "neither capacity nor fragmentation explains it")
    assert said(verdict, "a MIG slice smaller than the card")


def test_a_printed_allowed_cap_is_named_as_a_per_process_memory_fraction() -> None:
    verdict = verdict_of(
        "RuntimeError: CUDA out of memory. Tried to allocate 6.00 GiB (GPU 0; 12.00 GiB total"
        " capacity; 0 bytes already allocated; 11.50 GiB free; 6.00 GiB allowed; 0 bytes"
        " reserved in total by PyTorch)"
    )
    assert verdict.kind is FailureKind.UNKNOWN
    assert said(verdict, "6.00 GiB allowed: a per-process memory fraction cap")


def test_a_request_larger_than_the_card_is_a_true_oom_batch_levers_may_not_cure() -> None:
    # real/oom/082: 128 GiB asked of a 23.65 GiB card, with another process listed
    verdict = verdict_of(
        "CUDA out of memory. Tried to allocate 128.00 GiB. GPU 0 has a total capacty of 23.65 GiB"
        " of which 7.95 GiB is free. Process 1957120 has 7.10 GiB memory in use. Including"
        " non-PyTorch memory, this process has 8.58 GiB memory in use. Of the allocated memory"
        " 8.13 GiB is allocated by PyTorch, and 8.94 MiB is reserved by PyTorch but unallocated."
    )
    assert verdict.kind is FailureKind.TRUE_OOM
    assert said(verdict, "a single tensor bigger than the device")
    assert said(verdict, "batch levers at the same geometry may not help")
    assert verdict.cotenant_pids == ()


@pytest.mark.parametrize(
    "text",
    [
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory.",
        "CUDA out of memory. Tried to allocate 37252902.99 GiB (GPU 0; 14.74 GiB total capacity;"
        " 0 bytes already allocated; 14.64 GiB free; 0 bytes reserved in total by PyTorch)",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 18446744073709551615 bytes.",
    ],
)
def test_a_request_beyond_any_device_is_a_size_bug_not_an_oom(text: str) -> None:
    verdict = verdict_of(text)
    assert verdict.kind is FailureKind.NOT_OOM
    assert said(verdict, "beyond any device: a size bug in the program")


def test_an_absurd_nvml_figure_is_not_a_size_bug() -> None:
    # real/oom/102: this process "has **17179869184.00 GiB**" (2**64 bytes); the request is sane
    label = next(label for label in LABELS if label.file.startswith("102"))
    verdict = verdict_of((MESSAGES_DIR / label.file).read_text(encoding="utf-8"))
    assert verdict.kind is FailureKind.TRUE_OOM
    assert said(verdict, "this process's memory in use")  # the dropped figure, said


def test_with_expandable_segments_on_stranded_bytes_are_a_true_oom_and_it_says_why() -> None:
    text = new_format("22.00 MiB", "79.15 GiB", "11.06 MiB", "194.87 MiB")
    verdict = verdict_of(text, expandable=True, step=400)
    assert verdict.kind is FailureKind.TRUE_OOM
    assert said(verdict, "already had expandable_segments:True")
    assert said(verdict, "stranded bytes are not the story")
    assert verdict_of(text, expandable=False).kind is FailureKind.FRAGMENTATION


@pytest.mark.parametrize(
    "text",
    [
        # XPU (real/oom/017): no free figure, and U = 0 < X
        "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total"
        " capacity of 15.11 GiB. Of the allocated memory 0 bytes is allocated by PyTorch, and 0"
        " bytes is reserved by PyTorch but unallocated.",
        # cut after the request (real/oom/100)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU",
        # the parenthetical alone: no request (real/oom/036)
        "(GPU 0; 15.75 GiB total capacity; 79.11 MiB already allocated; 3.62 MiB free; 86.00 MiB"
        " reserved in total by PyTorch)",
    ],
)
def test_a_missing_figure_leaves_the_rule_undecided(text: str) -> None:
    verdict = verdict_of(text)
    assert verdict.kind is FailureKind.UNKNOWN
    assert verdict.oom is not None
    assert said(verdict, "cannot tell fragmentation from a full card")


def test_mps_over_its_watermark_is_a_true_oom_under_it_unknown() -> None:
    over = verdict_of(
        "MPS backend out of memory (MPS allocated: 16.00 GB, other allocations: 3.31 GB, max"
        " allowed: 18.13 GB). Tried to allocate 256 bytes on shared pool."
    )
    assert over.kind is FailureKind.TRUE_OOM
    assert said(over, "over its 18.13 GiB max allowed (the high watermark)")
    broken = verdict_of(
        "MPS backend out of memory (MPS allocated: 2.25 GiB, other allocations: 67108863.99 GiB,"
        " max allowed: 24.00 GiB). Tried to allocate 8.00 KiB on private pool."
    )
    assert broken.kind is FailureKind.UNKNOWN
    assert said(broken, "its accounting is broken")


def test_other_processes_on_a_card_the_rule_calls_full_are_cotenants() -> None:
    verdict = verdict_of(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
        " capacity of 79.15 GiB of which 100.00 MiB is free. Process 4242 has 30.00 GiB memory in"
        " use. Including non-PyTorch memory, this process has 48.00 GiB memory in use. Of the"
        " allocated memory 47.00 GiB is allocated by PyTorch, and 200.00 MiB is reserved by"
        " PyTorch but unallocated.",
        node="gpu-02",
    )
    assert verdict.kind is FailureKind.COTENANT
    assert verdict.cotenant_pids == (4242,)


def test_the_rule_reads_only_pytorch_figures() -> None:
    xla = verdict_of("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4770354232 bytes.")
    assert xla.kind is FailureKind.TRUE_OOM
    assert str(KIND_AS_RULE[xla.kind.value]) == RuleKind.TRUE_OOM


@pytest.mark.parametrize(
    ("name", "env", "expected"),
    [
        ("torchrun", None, False),  # PYTORCH_ALLOC_CONF=expandable_segments:False
        ("hf-trainer", None, None),  # PYTORCH_CUDA_ALLOC_CONF without the option
        ("deepspeed", {}, None),
        ("hf-trainer", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        (
            "torchrun",  # PYTORCH_ALLOC_CONF wins over the older name
            {
                "PYTORCH_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
            },
            True,
        ),
    ],
)
def test_the_daemon_reads_expandable_segments_from_the_lineage_template(
    name: str, env: dict[str, str] | None, expected: bool | None
) -> None:
    template = load_template(TEMPLATES / name)
    if env is not None:
        knobs = validate_knobs(template.dialect, {**template.knobs, "env": env})
        template = dataclasses.replace(template, knobs=knobs)
    assert template_expandable_segments(template) is expected


def test_a_report_built_by_hand_with_a_huge_request_is_a_size_bug() -> None:
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="CUDA out of memory.",
        requested_bytes=2**55,
        total_bytes=80 * 1024**3,
    )
    verdict = diagnose(Evidence(log=LogFindings(oom=oom)), History())
    assert verdict.kind is FailureKind.NOT_OOM
