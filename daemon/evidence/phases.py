"""Where in the run a failure happened: the phase from log lines, and `decide_phase` between
them and the traceback's frames.

Frames decide first (`frame_phases`: the tables of what each framework puts on a stack).
Log lines decide when the frames do not: the excerpt has no traceback, or only a forward in
view. The latest marker before the failure counts (`***** Running Evaluation *****`, `Saving
model checkpoint to`, `Loading checkpoint shards`, NCCL's communicator set-up lines), until a
training line (a training step, `***** Running training *****`) supersedes it. A marker older than
`STALE_AFTER_SECONDS` by the clock times the log prints is stale: a run set up minutes before it
died was training in the silence between. Frames that show training (a training frame, a
backward, an optimizer step) outrank every marker.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from daemon.evidence.frame_phases import FramePhase
from daemon.evidence.records import Phase

STALE_AFTER_SECONDS = 10 * 60  # a setup or eval marker this much older than the failure is stale
MAX_PHASE_CHANGES = 10_000  # the timeline keeps its latest changes and clock samples
CLOCK_HEAD_CHARS = 64  # a line's time stamp is printed at its head
CLOCK_STEP_SECONDS = 60  # the clock is sampled when it moves this much: staleness is in minutes
DAY_SECONDS = 24 * 60 * 60


_NCCL_INFO = re.compile(r"\bNCCL INFO\b")
# Teardown (`Abort`, `Destroy`), and NCCL's error unwinding (`NCCL INFO group.cc:96 -> 3`: its
# NCCLCHECK macro's `%s:%d -> %d` as an error is returned up the calls), which is no set-up
# (held-out sample 024).
_NCCL_TEARDOWN = re.compile(r"\b(?:Abort|Destroy)|NCCL INFO [\w./\-]{1,256}:[0-9]{1,7} -> [0-9]")

# Each pattern starts at a literal word or a bounded run (`\\*{3}`, never `\\*{3,}`, which costs
# quadratic time on a line of stars), and sees at most `MATCH_CHARS` twice of a line. Each comes
# with the literals (lower case) a line must hold for it to be tried at all.
_LINE_MARKERS: tuple[tuple[Phase, tuple[str, ...], re.Pattern[str]], ...] = (
    # Training goes on: these end an eval, a save or the set-up (UNKNOWN: nothing to claim).
    (
        Phase.UNKNOWN,
        (
            "training",
            "'loss'",
            "train_runtime",
            "'eval_",
            "done with setup",
            "saved checkpoint",
            "validation loss",
        ),
        re.compile(
            r"\*\*\* Running training \*\*\*"  # transformers Trainer's banner
            r"|\{'loss': |'train_runtime': "  # its training log dicts
            r"|'eval_\w+': "  # its eval results: the eval is over
            r"|\b(?:start(?:ing)?|begin(?:ning)?) (?:the )?training\b"
            r"|\btraining (?:started|begins)\b"
            r"|\bdone with setup\b|\bsuccessfully saved checkpoint\b"  # Megatron
            r"|\bvalidation loss at iteration\b",  # Megatron, after its eval
            re.IGNORECASE,
        ),
    ),
    (
        Phase.EVAL,
        ("running evaluation", "running prediction", "evaluating", "running validation"),
        re.compile(
            r"\*\*\* Running (?:evaluation|prediction) \*\*\*"  # transformers Trainer
            r"|\bEvaluating\b|\bRunning validation\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.CHECKPOINT_SAVE,
        ("sav",),
        re.compile(
            r"\bSaving model checkpoint to\b"  # transformers Trainer._save
            r"|\bsav(?:e|ing) (?:the )?(?:model|checkpoint|state|weights)\b"  # Megatron, accelerate
            r"|\bCheckpoint \S{1,200} is about to be saved\b",  # DeepSpeed
            re.IGNORECASE,
        ),
    ),
    (Phase.GENERATE, ("avg prompt throughput",), re.compile(r"\bAvg prompt throughput\b")),
    (
        Phase.SETUP,
        (
            "initiali",
            "store_based_barrier",
            "processes registered",
            "load",
            "sanity check",
            "building",
            "deepspeed",
            "zero stage",
            "gpu blocks",
            "memory profiling",
            "captur",
            "name",
        ),
        re.compile(
            r"\binitiali[sz](?:e[ds]?|ing|ation)\b"  # distributed / model-parallel / engine init
            r"|\bstore_based_barrier_key\b|\bAll distributed processes registered\b"
            r"|\bload(?:ing)? (?:the )?(?:pretrained )?(?:model|checkpoint|weights?|state[ _]dict"
            r"|configuration file|config file|dataset)\b"
            r"|\bsanity check\b"  # icefall's pre-training OOM scan (sample 047)
            r"|\bbuilding\b[^|]{0,40}\b(?:model|datasets?)\b"  # Megatron's `> building ...`
            r"|\bDeepSpeed (?:info|Basic Optimizer|Final Optimizer)\b"
            r"|\bCreating \S{1,40} ZeRO stage\b"
            r"|\bGPU blocks: |\bMemory profiling\b|\bGraph capturing\b"  # vLLM engine start-up
            r"|\bcaptur\w* (?:the model for )?(?:CUDA ?graphs?|cudagraphs?)\b"
            r"|^\s*\|\s*Name\s*\|\s*Type\s*\|\s*Params",  # Lightning's model summary
            re.IGNORECASE,
        ),
    ),
    # The communicator's set-up lines (sample 023), not its teardown (`Abort`, `Destroy`).
    (Phase.SETUP, ("nccl info",), _NCCL_INFO),
)
# A loop's progress bar, by the words before its counter: which loop it is. The first that
# matches wins; a bar none matches is the training loop's (HF Trainer's bar has no words).
_LOOP_WORDS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (Phase.SETUP, re.compile(r"\bgenerating \w+ split\b", re.IGNORECASE)),  # datasets
    (
        Phase.EVAL,
        re.compile(
            r"\b(?:eval\w*|validat\w*|valid|val|test(?:ing)?|predict\w*|sanity checking"
            r"|inference)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.GENERATE,
        re.compile(
            r"\b(?:generat\w*|processed prompts|adding requests|sampl(?:e|er|ing)|decod(?:e|ing)"
            r"|rollouts?)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.SETUP,
        re.compile(
            r"\b(?:load(?:ing)?|download(?:ing)?|fetch(?:ing)?|captur(?:e|ing)|initiali[sz]\w*"
            r"|compil(?:e|ing)|warm(?:ing)?[ -]?up|map|filter(?:ing)?|tokeniz\w*|preprocess\w*"
            r"|convert(?:ing)?|shuffl\w*|packing|grouping|concatenat\w*|resolving|extracting"
            r"|building|creating)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.CHECKPOINT_SAVE,
        re.compile(r"\b(?:sav(?:e|ing)|writ(?:e|ing)|upload\w*)\b", re.IGNORECASE),
    ),
)
# A wall-clock time at a line's head (`[2023-07-10 04:09:42,841]`, `E0325 20:57:27.62`,
# `ERROR 10-11 12:27:29`), never a tqdm elapsed time (`[6:28:43<94:39:17`).
_CLOCK = re.compile(r"(?:(?<=[\sT])|^)([01][0-9]|2[0-3]):([0-5][0-9]):([0-5][0-9])(?![0-9<])")


def line_marker(segment: str) -> tuple[int, Phase] | None:
    """The last phase marker in one line (one `\\r` redraw of it): its position and phase."""
    found: tuple[int, Phase] | None = None
    lowered = segment.lower()
    for phase, gate, pattern in _LINE_MARKERS:
        if not any(literal in lowered for literal in gate):
            continue
        if pattern is _NCCL_INFO and _NCCL_TEARDOWN.search(segment):
            continue
        for match in pattern.finditer(segment):
            if found is None or match.start() > found[0]:
                found = (match.start(), phase)
    return found


def loop_phase(words: str) -> Phase | None:
    """Which loop a progress counter counts, by the words before it; None: the training loop."""
    for phase, pattern in _LOOP_WORDS:
        if pattern.search(words):
            return phase
    return None


def clock_seconds(text: str) -> int | None:
    """The time of day a line's head prints, in seconds; None when it prints none."""
    match = _CLOCK.search(text[:CLOCK_HEAD_CHARS])
    if match is None:
        return None
    hours, minutes, seconds = (int(group) for group in match.groups())
    return hours * 3600 + minutes * 60 + seconds


@dataclass(frozen=True)
class _Change:
    offset: int
    phase: Phase
    line: str
    clock: int | None


@dataclass
class PhaseTimeline:
    """The phase the log lines put the run in, as it changed through the log, and its clock."""

    changes: deque[_Change] = field(default_factory=lambda: deque(maxlen=MAX_PHASE_CHANGES))
    clocks: deque[tuple[int, int]] = field(  # (offset, seconds), sampled
        default_factory=lambda: deque(maxlen=MAX_PHASE_CHANGES)
    )
    clock: int | None = None

    @property
    def current(self) -> Phase:
        return self.changes[-1].phase if self.changes else Phase.UNKNOWN

    def see_clock(self, offset: int, text: str) -> None:
        seconds = clock_seconds(text)
        if seconds is None:
            return
        self.clock = seconds
        last = self.clocks[-1][1] if self.clocks else None
        if last is None or abs(seconds - last) >= CLOCK_STEP_SECONDS:
            self.clocks.append((offset, seconds))

    def mark(self, offset: int, phase: Phase, line: str) -> None:
        """The run entered `phase` at this line (UNKNOWN: back to training)."""
        if phase is self.current and (phase is Phase.UNKNOWN or self.changes[-1].line == line):
            return
        self.changes.append(_Change(offset, phase, line[:1000], self.clock))

    def at(self, offset: int) -> tuple[Phase, str] | None:
        """The phase the lines claim at `offset` (a failure there), or None if they claim none."""
        index = bisect_right([change.offset for change in self.changes], offset) - 1
        if index < 0 or self.changes[index].phase is Phase.UNKNOWN:
            return None
        change = self.changes[index]
        clock_index = bisect_right([at for at, _ in self.clocks], offset) - 1
        now = self.clocks[clock_index][1] if clock_index >= 0 else None
        stale = (
            change.clock is not None
            and now is not None
            and (now - change.clock) % DAY_SECONDS > STALE_AFTER_SECONDS
        )
        return None if stale else (change.phase, change.line)


def decide_phase(frames: FramePhase, line: tuple[Phase, str] | None) -> tuple[Phase, str | None]:
    """Frames that settle it win; then the log line's phase; then a forward or placement frame."""
    if frames.settled or line is None:
        return frames.phase, frames.decided_by
    return line
