"""The real corpus (`tests/data/real/oom`, `tests/data/real/logs`) and the product's answers on it.

The labels are read into typed records, strictly: a misspelt key or a wrong type is an error
here, not a silently missing label. Each sample is then given to the product the way an
operator would give it (`slurm-medic diagnose --log FILE --json`, run in-process) and each
labelled field is compared with what the product printed. A field the label leaves out (the
text does not show it) agrees only when the product says nothing either: a claim there is a
false positive.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, TypeVar

from click.testing import CliRunner

from daemon.cli import main

REAL = Path(__file__).parent / "data" / "real"
MESSAGES_DIR = REAL / "oom"
LOGS_DIR = REAL / "logs"
LABELS_FILE = "labels.toml"

_Word = TypeVar("_Word", bound=StrEnum)
_Value = TypeVar("_Value")


class RuleKind(StrEnum):
    """A message's kind by the fragmentation rule (issue 11 section 3), as the labels name it."""

    FRAGMENTATION = "fragmentation"
    TRUE_OOM = "true_oom"
    UNKNOWN = "unknown"  # the driver had room, or the rule lacks a number
    NOT_TORCH = "not_torch"  # an out-of-memory with no allocator figures to apply the rule to
    NOT_OOM = "not_oom"  # not a GPU out-of-memory at all


class MessageFamily(StrEnum):
    """Which software printed a message, as the labels name it (README's family table)."""

    TORCH_CUDA = "torch_cuda"
    TORCH_HIP = "torch_hip"
    TORCH_XPU = "torch_xpu"
    TORCH_MPS = "torch_mps"
    CUDA_RUNTIME = "cuda_runtime"
    CUBLAS = "cublas"
    CUDNN = "cudnn"
    NCCL = "nccl"
    XLA = "xla"
    TENSORFLOW = "tensorflow"
    KV_CACHE = "kv_cache"  # an inference engine's KV-cache sizing (vLLM, SGLang)
    OTHER = "other"


class RootCause(StrEnum):
    """The earliest root failure of a log excerpt, as the labels name it."""

    CUDA_OOM = "cuda_oom"
    HOST_RAM = "host_ram"
    GPU_FAULT = "gpu_fault"
    NCCL_TIMEOUT = "nccl_timeout"
    OTHER_ERROR = "other_error"
    NONE = "none"


# The product's words mapped onto the labels' words: the one place where the two vocabularies
# meet. A product word missing from a table is compared as it is, so a kind or phase the
# parsers add later (e.g. a `setup` phase) agrees as soon as it uses the labels' word.
#
# Verdict kind -> the fragmentation rule's outcome. The OOM sub-kinds are true OOMs told apart
# by where they happened; host RAM and hardware are no GPU out-of-memory. `cotenant` has no
# counterpart (the rule reads only X, F and U), so it disagrees with every label.
KIND_AS_RULE: Final[Mapping[str, RuleKind]] = {
    "fragmentation": RuleKind.FRAGMENTATION,
    "true_oom": RuleKind.TRUE_OOM,
    "workspace_spike": RuleKind.TRUE_OOM,
    "optimizer_burst": RuleKind.TRUE_OOM,
    "eval_growth": RuleKind.TRUE_OOM,
    "unknown": RuleKind.UNKNOWN,
    "not_oom": RuleKind.NOT_OOM,
    "host_ram": RuleKind.NOT_OOM,
    "hardware": RuleKind.NOT_OOM,
}
# Phase -> the labels' phase; `unknown` says nothing. The labels call the eval/generate phase
# `generate` (the product's `generate` and `setup` are the labels' words already).
# The log's root cause needs no table: `diagnose --json` prints it in the labels' words
# (`root_cause`, null where the log shows no failure: the labels' `none`).
PHASE_AS_LABEL: Final[Mapping[str, str | None]] = {
    "forward": "forward",
    "backward": "backward",
    "optimizer_step": "optimizer",
    "eval": "generate",
    "checkpoint_save": "checkpoint_save",
    "data_loading": "data_loading",
    "unknown": None,
}
# A message the rule cannot apply to (no allocator figures) is read right when the product
# recognised an out-of-memory report and claimed no outcome that needs those figures.
NOT_TORCH_ACCEPTS: Final = frozenset({RuleKind.TRUE_OOM, RuleKind.UNKNOWN})
# What the product's `unknown` means when it read no OOM report at all: not the rule's outcome.
NO_OOM_READ: Final = "unknown (no OOM report read)"


class CorpusError(ValueError):
    """A labels file that does not follow its README: a missing, unknown or mistyped key."""


@dataclass(frozen=True)
class Numbers:
    """The allocator figures of one OOM message, exact in bytes; None where not printed."""

    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_in_use_bytes: int | None = None


NUMBER_FIELDS: Final = tuple(field.name for field in fields(Numbers))


@dataclass(frozen=True)
class MessageLabel:
    """One `[[sample]]` of `oom/labels.toml`."""

    file: str
    source: str
    software: str
    family: MessageFamily
    message_line: str
    numbers: Numbers
    expandable_segments: bool
    kind: RuleKind
    arithmetic: str
    notes: str
    cut_top_lines: int | None = None
    allowed_bytes: int | None = None  # MPS's "max allowed", or a CUDA/HIP message's "N allowed"


@dataclass(frozen=True)
class LogLabel:
    """One `[[sample]]` of `logs/labels.toml`; each field comes with the line that decides it."""

    file: str
    source: str
    launcher: str
    framework: str
    root_cause: RootCause
    root_cause_line: str
    notes: str
    cut_top_lines: int | None = None
    rank: int | None = None
    rank_line: str | None = None
    host: str | None = None
    host_line: str | None = None
    step: int | None = None
    step_line: str | None = None
    phase: str | None = None
    phase_line: str | None = None

    def quoted_lines(self) -> dict[str, str]:
        """Every `*_line` the label quotes, by key."""
        quoted = {
            "root_cause_line": self.root_cause_line,
            "rank_line": self.rank_line,
            "host_line": self.host_line,
            "step_line": self.step_line,
            "phase_line": self.phase_line,
        }
        return {key: line for key, line in quoted.items() if line is not None}


@dataclass(frozen=True)
class ProductAnswer:
    """What `slurm-medic diagnose --log FILE --json` said about one sample."""

    exit_code: int
    kind: str | None = None  # None when no verdict was printed
    rank: int | None = None
    host: str | None = None
    step: int | None = None
    phase: str | None = None  # in the product's words
    read_oom: bool = False  # the verdict carries an OOM report
    root_cause: str | None = None  # the log's root cause as printed; None: no failure shown
    numbers: Numbers = Numbers()
    error: str | None = None  # why no verdict was printed

    @property
    def answered(self) -> bool:
        return self.exit_code == 0 and self.error is None


@dataclass(frozen=True)
class Comparison:
    """One labelled field of one sample against the product's answer, in the labels' words."""

    corpus: str
    file: str
    field: str
    label: str | int | None
    product: str | int | None
    agrees: bool


@dataclass(frozen=True)
class Score:
    """How the product did on one field of one corpus: over every sample, over the samples
    whose text shows the field, and how often it claimed a value the text does not show."""

    corpus: str
    field: str
    agree: int
    total: int
    labelled_agree: int
    labelled_total: int
    false_claims: int

    @property
    def percent(self) -> float:
        return _percent(self.agree, self.total)

    @property
    def labelled_percent(self) -> float:
        return _percent(self.labelled_agree, self.labelled_total)


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


# --- labels ------------------------------------------------------------------------------

_MESSAGE_KEYS: Final = frozenset(
    {
        "file",
        "source",
        "cut_top_lines",
        "software",
        "family",
        "message_line",
        "expandable_segments",
        "kind",
        "arithmetic",
        "notes",
        "allowed_bytes",
        *NUMBER_FIELDS,
    }
)
_LOG_KEYS: Final = frozenset(field.name for field in fields(LogLabel))


def load_message_labels(directory: Path = MESSAGES_DIR) -> tuple[MessageLabel, ...]:
    """Every entry of the messages' labels file, in file order."""
    entries = _samples(directory / LABELS_FILE)
    return tuple(_message_label(_Entry(entry, _MESSAGE_KEYS)) for entry in entries)


def load_log_labels(directory: Path = LOGS_DIR) -> tuple[LogLabel, ...]:
    """Every entry of the logs' labels file, in file order."""
    entries = _samples(directory / LABELS_FILE)
    return tuple(_log_label(_Entry(entry, _LOG_KEYS)) for entry in entries)


def _samples(path: Path) -> list[Mapping[str, Any]]:
    with path.open("rb") as handle:
        document = tomllib.load(handle)
    samples = document.get("sample")
    if set(document) != {"sample"} or not isinstance(samples, list):
        raise CorpusError(f"{path}: expected only [[sample]] tables")
    return samples


class _Entry:
    """One `[[sample]]` table, read key by key with its type checked."""

    def __init__(self, table: Mapping[str, Any], allowed: frozenset[str]) -> None:
        self.name = str(table.get("file", "<no file key>"))
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise CorpusError(f"{self.name}: unknown keys {unknown}")
        self._table = table

    def text(self, key: str) -> str:
        value = self.optional_text(key)
        if value is None:
            raise CorpusError(f"{self.name}: {key} is missing")
        return value

    def optional_text(self, key: str) -> str | None:
        value = self._table.get(key)
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{self.name}: {key} is not a string")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self._table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CorpusError(f"{self.name}: {key} is not an integer")
        return value

    def flag(self, key: str) -> bool:
        value = self._table.get(key)
        if not isinstance(value, bool):
            raise CorpusError(f"{self.name}: {key} is not true or false")
        return value

    def choice(self, key: str, enum: type[_Word]) -> _Word:
        value = self.text(key)
        try:
            return enum(value)
        except ValueError:
            raise CorpusError(f"{self.name}: {key} = {value!r} is not one of its words") from None


def _message_label(entry: _Entry) -> MessageLabel:
    return MessageLabel(
        file=entry.text("file"),
        source=entry.text("source"),
        software=entry.text("software"),
        family=entry.choice("family", MessageFamily),
        message_line=entry.text("message_line"),
        numbers=Numbers(**{name: entry.optional_int(name) for name in NUMBER_FIELDS}),
        expandable_segments=entry.flag("expandable_segments"),
        kind=entry.choice("kind", RuleKind),
        arithmetic=entry.text("arithmetic"),
        notes=entry.text("notes"),
        cut_top_lines=entry.optional_int("cut_top_lines"),
        allowed_bytes=entry.optional_int("allowed_bytes"),
    )


def _log_label(entry: _Entry) -> LogLabel:
    return LogLabel(
        file=entry.text("file"),
        source=entry.text("source"),
        launcher=entry.text("launcher"),
        framework=entry.text("framework"),
        root_cause=entry.choice("root_cause", RootCause),
        root_cause_line=entry.text("root_cause_line"),
        notes=entry.text("notes"),
        cut_top_lines=entry.optional_int("cut_top_lines"),
        rank=entry.optional_int("rank"),
        rank_line=entry.optional_text("rank_line"),
        host=entry.optional_text("host"),
        host_line=entry.optional_text("host_line"),
        step=entry.optional_int("step"),
        step_line=entry.optional_text("step_line"),
        phase=entry.optional_text("phase"),
        phase_line=entry.optional_text("phase_line"),
    )


def sample_lines(path: Path) -> list[str]:
    """A sample's lines exactly as stored: no newline translation, no stripping."""
    return path.read_bytes().decode("utf-8").split("\n")


# --- the product ---------------------------------------------------------------------------


def run_diagnose(path: Path) -> ProductAnswer:
    """`slurm-medic diagnose --log PATH --json`, in-process: the operator's path end to end."""
    result = CliRunner().invoke(main, ["diagnose", "--log", str(path), "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return ProductAnswer(result.exit_code, error=repr(result.exception))
    if result.exit_code != 0:
        return ProductAnswer(result.exit_code, error=result.stderr.strip() or "no message")
    try:
        return _answer(json.loads(result.stdout))
    except (ValueError, TypeError, KeyError) as error:
        return ProductAnswer(result.exit_code, error=f"unreadable verdict: {error!r}")


def _answer(verdict: Mapping[str, Any]) -> ProductAnswer:
    oom = verdict["oom"]
    numbers = Numbers()
    if oom is not None:
        numbers = Numbers(**{name: _typed(oom[name], int) for name in NUMBER_FIELDS})
    return ProductAnswer(
        exit_code=0,
        kind=_typed(verdict["kind"], str),
        rank=_typed(verdict["rank"], int),
        host=_typed(verdict["node"], str),
        step=_typed(verdict["step"], int),
        phase=_typed(verdict["phase"], str),
        read_oom=oom is not None,
        numbers=numbers,
        root_cause=_typed(verdict["root_cause"], str),
    )


def _typed(value: object, kind: type[_Value]) -> _Value | None:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise TypeError(f"{value!r} is not {kind.__name__}")


# --- comparing ----------------------------------------------------------------------------


def product_rule_kind(answer: ProductAnswer) -> str | None:
    """The product's verdict in the fragmentation rule's words (see `KIND_AS_RULE`)."""
    if answer.kind is None:
        return None
    kind = str(KIND_AS_RULE.get(answer.kind, answer.kind))
    if kind == RuleKind.UNKNOWN and not answer.read_oom:
        return NO_OOM_READ
    return kind


def kind_agrees(label: RuleKind, product: str | None) -> bool:
    """A not_torch message is read right by any OOM verdict that needs no allocator figures."""
    if label is RuleKind.NOT_TORCH:
        return product in NOT_TORCH_ACCEPTS
    return product == label


def compare_message(label: MessageLabel, answer: ProductAnswer) -> tuple[Comparison, ...]:
    """The kind and each of the six numbers of one message."""
    product_kind = product_rule_kind(answer)
    rows = [
        Comparison(
            "oom",
            label.file,
            "kind",
            label.kind.value,
            product_kind,
            kind_agrees(label.kind, product_kind),
        )
    ]
    for name in NUMBER_FIELDS:
        expected = getattr(label.numbers, name)
        got = getattr(answer.numbers, name)
        rows.append(Comparison("oom", label.file, name, expected, got, expected == got))
    return tuple(rows)


def compare_log(label: LogLabel, answer: ProductAnswer) -> tuple[Comparison, ...]:
    """Rank, host, step, phase and root cause of one log excerpt."""
    phase = None if answer.phase is None else PHASE_AS_LABEL.get(answer.phase, answer.phase)
    root_cause = None
    if answer.answered:
        root_cause = answer.root_cause or RootCause.NONE.value
    pairs: tuple[tuple[str, str | int | None, str | int | None], ...] = (
        ("rank", label.rank, answer.rank),
        ("host", label.host, answer.host),
        ("step", label.step, answer.step),
        ("phase", label.phase, phase),
        ("root_cause", label.root_cause.value, root_cause),
    )
    return tuple(
        Comparison("logs", label.file, field, expected, got, expected == got)
        for field, expected, got in pairs
    )


@dataclass(frozen=True)
class Measurement:
    """The product on the whole corpus: every comparison, and the samples it gave no verdict."""

    comparisons: tuple[Comparison, ...]
    failures: tuple[tuple[str, ProductAnswer], ...]  # (file, answer) without a verdict
    samples: int


def measure(
    messages: Sequence[MessageLabel] | None = None,
    logs: Sequence[LogLabel] | None = None,
    *,
    messages_dir: Path = MESSAGES_DIR,
    logs_dir: Path = LOGS_DIR,
) -> Measurement:
    """Run the product on every labelled sample (both corpora unless given) and compare.

    The directories let a held-out set kept outside the tree be measured the same way."""
    messages = load_message_labels(messages_dir) if messages is None else messages
    logs = load_log_labels(logs_dir) if logs is None else logs
    comparisons: list[Comparison] = []
    failures: list[tuple[str, ProductAnswer]] = []
    for message in messages:
        answer = run_diagnose(messages_dir / message.file)
        comparisons.extend(compare_message(message, answer))
        if not answer.answered:
            failures.append((message.file, answer))
    for log in logs:
        answer = run_diagnose(logs_dir / log.file)
        comparisons.extend(compare_log(log, answer))
        if not answer.answered:
            failures.append((log.file, answer))
    return Measurement(tuple(comparisons), tuple(failures), len(messages) + len(logs))


def scores(comparisons: Iterable[Comparison]) -> tuple[Score, ...]:
    """Agreement per (corpus, field) in first-seen order, then `numbers`: all six exact."""
    rows: dict[tuple[str, str], list[Comparison]] = {}
    for row in comparisons:
        rows.setdefault((row.corpus, row.field), []).append(row)
    result = [_score(corpus, field, group) for (corpus, field), group in rows.items()]
    numbers = [row for (_, field), group in rows.items() if field in NUMBER_FIELDS for row in group]
    if numbers:
        after = max(i for i, score in enumerate(result) if score.field in NUMBER_FIELDS) + 1
        result.insert(after, _all_numbers_score(numbers))
    return tuple(result)


def _score(corpus: str, field: str, rows: Sequence[Comparison]) -> Score:
    labelled = [row for row in rows if row.label is not None]
    return Score(
        corpus,
        field,
        agree=sum(row.agrees for row in rows),
        total=len(rows),
        labelled_agree=sum(row.agrees for row in labelled),
        labelled_total=len(labelled),
        false_claims=sum(row.label is None and row.product is not None for row in rows),
    )


def _all_numbers_score(rows: Sequence[Comparison]) -> Score:
    """One row per message: all its numbers exact; labelled where it prints any number."""
    by_file: dict[str, list[Comparison]] = {}
    for row in rows:
        by_file.setdefault(row.file, []).append(row)
    exact = {file: all(row.agrees for row in group) for file, group in by_file.items()}
    labelled = [file for file, group in by_file.items() if any(r.label is not None for r in group)]
    claimed = [
        file
        for file, group in by_file.items()
        if any(row.label is None and row.product is not None for row in group)
    ]
    return Score(
        rows[0].corpus,
        "numbers",
        agree=sum(exact.values()),
        total=len(exact),
        labelled_agree=sum(exact[file] for file in labelled),
        labelled_total=len(labelled),
        false_claims=len(claimed),
    )
