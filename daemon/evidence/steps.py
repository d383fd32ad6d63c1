"""The training step a run reached: the step vocabulary, and which step the failing rank was at.

A step pattern is a regular expression; its named groups say what it reads (a user's
`--step-pattern` reads its first group as the training step):

- `step`: the training step itself (Megatron's `iteration 48/50`, DeepSpeed's `step=1249`);
- `n` (with `total` where printed): a loop's counter, a tqdm bar's `N/M` or `Nit [`. Which loop
  it counts is read from the words before it on the line (`loop_phase`): `Loading checkpoint
  shards: 57% 4/7`, `Validation DataLoader 0: 40%|...| 2/5`, `[Eval batch=3/3]` count a loading,
  an eval, not training. A bar with no words (HF Trainer's training bar and its eval bar look
  alike) counts training, except inside an eval the log lines announced (`***** Running
  Evaluation *****`): there a bar of another length than the training bar's is the eval's;
- `done`: a count of the steps done, printed once the run ended (detectron2's `Overall
  training speed: 22 iterations`), taken only when no progress line is in view.

A `\\r`-redrawn line holds many states of a bar: the last training one counts. Epoch counts,
sample counts and dataset sizes are not steps and no pattern reads them.

Which step: the failing rank's last progress line before its root failure where the prefixes
say which lines are its own; when its own lines all come after (its bar redrawn as it closed,
or stdout flushed after stderr's traceback), the last of those before the cascade. When it
logged none, the other ranks' last step before the cascade counts (ranks step together), and
with no rank known, the last step before the failure. Steps before a `***** Running training
*****` banner belong to another run (a data-preparation bar, an earlier attempt).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from daemon.evidence.phases import PhaseTimeline, line_marker, loop_phase
from daemon.evidence.records import MAX_STEP, Phase
from daemon.evidence.units import bounded_int

MATCH_CHARS = 8 * 1024  # of a longer redraw, only its first and last 8 KB are matched
MAX_REDRAWS_READ = 64  # of a line's `\r` redraws, the last ones: the state it ended in
LOOP_WORDS_CHARS = 120  # how far before a counter its loop's words are looked for
MAX_LINE_CHARS = 1000  # of the line kept to say which line decided

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_TRAINING_BANNER = re.compile(r"\*\*\* Running training \*\*\*", re.IGNORECASE)
_SCIENTIFIC = re.compile(r"[0-9](?:\.[0-9]{1,6})?e\+?[0-9]{1,2}")

# Tried in this order on each redraw; the first that matches reads it. Every number is
# anchored by a literal or a look-behind before it, so a run of digits is read from its start.
# Each comes with the literals (lower case) a line must hold for it to be tried at all: most
# lines hold none, and a substring test costs far less than a regular expression.
_DEFAULT_STEPS: tuple[tuple[tuple[str, ...], re.Pattern[str]], ...] = (
    # Megatron-LM `training_log`: ` [2025-10-02 12:20:48] iteration       48/      50 |`
    # (sample 037; megatron/training/training.py)
    (("iteration",), re.compile(r"\biteration\s+(?P<step>[0-9]+)\s*/\s*(?P<total>[0-9]+)")),
    # Megatron-LM's and NeMo's other lines that name the iteration reached (training.py
    # `evaluate_and_print_results`: ` validation loss at iteration 150 on test set | ...`;
    # checkpointing.py: `saving checkpoint at iteration     150 to ...`, `successfully saved
    # checkpoint from iteration     150 to ...`, `... loaded checkpoint from ... at iteration
    # 150`); held-out sample 053
    (
        ("iteration",),
        re.compile(r"\b(?:at|from) iteration[ \t]{1,16}(?P<step>[0-9]{1,12})\b(?![./])"),
    ),
    # PyTorch's ImageNet example and mmcv/mmengine: `Epoch: [0][511/1736]` (sample 016),
    # `Epoch(train)  [1][ 50/500]`
    (
        ("/",),
        re.compile(r"\[\s*[0-9]+\s*\]\s*\[\s*(?P<n>[0-9]+)\s*/\s*(?P<total>[0-9]+)\s*\]"),
    ),
    # tqdm (HF Trainer, Lightning, diffusers `Steps:`): `| 450/1000 [`, and `57% 4/7 [` without
    # a bar (samples 004, 007, 030, 038)
    (("/",), re.compile(r"(?:\||[0-9]%)\s*(?P<n>[0-9]+)/(?P<total>[0-9]+)\s*\[")),
    # tqdm with no total: `32040it [6:28:43, 1.37it/s]`
    (("it [",), re.compile(r"(?<![\w.])(?P<n>[0-9]+)it \[")),
    # Composer `[batch=16/938]` / `[Eval batch=3/3]` (composer/loggers/console_logger.py),
    # `Step [100/600]`, `Iter(train) [50/1000]`, DLRM's `in train batch: 127687 / 263115`
    # (sample 026)
    (
        ("/",),
        re.compile(
            r"\b(?:step|iter|iteration|batch)(?:\(\w+\))?\s*[:=]?\s*\[?\s*(?P<n>[0-9]+)\s*/\s*"
            r"(?P<total>[0-9]+)",
            re.IGNORECASE,
        ),
    ),
    # DeepSpeed `_report_progress`: `[Rank 0] step=1249, skipped=0, lr=...`
    (("step=",), re.compile(r"\bstep=(?P<step>[0-9]+)")),
    # A step in a printed dict or JSON: `{'loss': 1.2, 'step': 40}`, `"global_step": 40`
    (("step'", 'step"'), re.compile(r"[\"'](?:global_)?step[\"']\s*:\s*(?P<step>[0-9]+)")),
    # fairseq: `num_updates=100`, `"num_updates": "100"`
    (("num_updates",), re.compile(r"\bnum_updates[\"']?\s*[:=]\s*[\"']?(?P<step>[0-9]+)")),
    # detectron2's CommonMetricPrinter `iter: 19  total_loss: ...`, nanoGPT's `iter 100: loss`
    (("iter",), re.compile(r"\biter(?::\s*|\s+)(?P<step>[0-9]+)\b(?![./])")),
    # `step 95,`, `Step: 40`, `global_step: 40`; one run of spaces either side of the `:`
    (
        ("step",),
        re.compile(
            r"\b(?:global[_ ])?step\s*(?:[:=]\s*)?(?P<step>[0-9]+)\b(?![.\d])", re.IGNORECASE
        ),
    ),
    # Lightning's progress-bar postfix rounds it: `global_step=3.2e+4` (sample 007)
    (
        ("global_step=",),
        re.compile(r"\bglobal_step=(?P<step>[0-9](?:\.[0-9]{1,6})?e\+?[0-9]{1,2})\b"),
    ),
    # detectron2's IterationTimer, printed after the run: `Overall training speed: 22 iterations
    # in 0:01:02` (sample 046; detectron2/engine/hooks.py)
    (
        ("overall training speed",),
        re.compile(r"\bOverall training speed: (?P<done>[0-9]+) iterations\b"),
    ),
)
DEFAULT_STEP_PATTERNS = tuple(pattern for _, pattern in _DEFAULT_STEPS)
_GATES = {pattern: gate for gate, pattern in _DEFAULT_STEPS}


@dataclass(frozen=True)
class Progress:
    """One progress counter read from a line."""

    number: int
    kind: str  # "step" (the training step), "n" (a loop's counter) or "done" (steps done)
    total: int | None
    loop: Phase | None  # of an "n": the loop it counts by its words; None: training
    start: int  # where in the redraw it was read


@dataclass(frozen=True)
class StepMark:
    """A training step a line shows: where, which rank printed it, and the line."""

    offset: int
    step: int
    rank: int | None
    line: str


def _segments(text: str) -> list[str]:
    """A tqdm line redrawn with `\\r` holds several states; the last ones, in order."""
    segments = [segment for segment in _ANSI.sub("", text).split("\r") if segment.strip()]
    return segments[-MAX_REDRAWS_READ:]


def _matchable(text: str) -> str:
    if len(text) <= 2 * MATCH_CHARS:
        return text
    return f"{text[:MATCH_CHARS]} [...] {text[-MATCH_CHARS:]}"


def _number(text: str) -> int | None:
    if _SCIENTIFIC.fullmatch(text):
        return round(float(text))
    step = bounded_int(text, MAX_STEP)
    return step if step is not None and step >= 0 else None


def _progress(
    segment: str, patterns: tuple[re.Pattern[str], ...], note: Callable[[str], None] | None
) -> Progress | None:
    """The first pattern's reading of one redraw; an implausible number is noted and dropped."""
    lowered = segment.lower()
    for pattern in patterns:
        gate = _GATES.get(pattern)
        if gate is not None and not any(literal in lowered for literal in gate):
            continue
        match = pattern.search(segment)
        if match is None:
            continue
        names = pattern.groupindex
        kind = next((name for name in ("n", "done", "step") if name in names), "step")
        digits = match.group(kind if kind in names else 1) or ""
        number = _number(digits)
        if number is None:
            if note is not None:
                note(f"a step beyond 0..{MAX_STEP} was dropped")
            return None
        total = bounded_int(match.group("total"), MAX_STEP) if "total" in names else None
        loop = None
        if kind == "n":
            words = segment[max(0, match.start() - LOOP_WORDS_CHARS) : match.start(kind)]
            loop = loop_phase(words)
        return Progress(number, kind, total, loop, match.start())
    return None


def _skipped(text: str) -> bool:
    # Slurm's "step 123.0" is a job step; slurmstepd may print its node (`slurmstepd-gpu20-15:`)
    return "slurmstepd" in text or "srun:" in text


def find_step(
    text: str, patterns: tuple[re.Pattern[str], ...], note: Callable[[str], None] | None = None
) -> int | None:
    """The training step of the line's last redraw that shows one (no section context)."""
    if _skipped(text):
        return None
    for segment in reversed(_segments(text)):
        body = _matchable(segment)
        progress = _progress(body, patterns, note)
        if progress is not None and progress.kind != "done" and progress.loop is None:
            return progress.number
    return None


@dataclass
class ProgressTracker:
    """Progress and phase lines read forward through the kept lines of a log."""

    patterns: tuple[re.Pattern[str], ...]
    marks: list[StepMark] = field(default_factory=list)
    done: list[StepMark] = field(default_factory=list)
    banners: list[int] = field(default_factory=list)  # offsets of `Running training` banners
    timeline: PhaseTimeline = field(default_factory=PhaseTimeline)
    training_total: int | None = None

    def read(
        self,
        offset: int,
        rank: int | None,
        text: str,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """Take one line's training step, loop counter and phase marker, if it shows any."""
        if _skipped(text):
            return
        self.timeline.see_clock(offset, text)
        line_phase: tuple[Phase, str] | None = None
        for segment in reversed(_segments(text)):
            body = _matchable(segment)
            progress = _progress(body, self.patterns, note)
            loop = self._loop(progress) if progress is not None else None
            if line_phase is None:
                marker = line_marker(body)
                if marker is not None or (progress is not None and progress.kind != "done"):
                    line_phase = (self._segment_phase(progress, loop, marker), segment)
                    if _TRAINING_BANNER.search(body):
                        self.banners.append(offset)
            if progress is not None and loop is None:
                self._mark(offset, rank, progress, segment)
                break  # the line's last training step; what came before it is superseded
        if line_phase is not None:
            self.timeline.mark(offset, *line_phase)

    def _loop(self, progress: Progress) -> Phase | None:
        """The loop a counter counts; inside an announced eval, a bar of another length."""
        if progress.kind != "n" or progress.loop is not None:
            return progress.loop
        current = self.timeline.current
        if current in (Phase.EVAL, Phase.GENERATE) and progress.total != self.training_total:
            return current
        return None

    @staticmethod
    def _segment_phase(
        progress: Progress | None, loop: Phase | None, marker: tuple[int, Phase] | None
    ) -> Phase:
        """The phase a redraw ends in: its marker, or its counter's loop if that came later."""
        counted = Phase.UNKNOWN if loop is None else loop
        if marker is None:
            return counted
        if progress is None or progress.kind != "n" or marker[0] > progress.start:
            return marker[1]  # `Saving checkpoint at step 500` saves; a bar glued after counts
        return counted

    def _mark(self, offset: int, rank: int | None, progress: Progress, segment: str) -> None:
        mark = StepMark(offset, progress.number, rank, segment[:MAX_LINE_CHARS])
        if progress.kind == "done":
            self.done.append(mark)
            return
        if progress.kind == "n" and progress.total is not None:
            self.training_total = progress.total
        self.marks.append(mark)

    def max_step(self) -> int | None:
        return max((mark.step for mark in self.marks), default=None)

    def step_at_failure(
        self, offset: int, rank: int | None, *, own_lines: bool, cascade_at: int | None
    ) -> StepMark | None:
        """The step the failing rank reached (see the module doc).

        `own_lines`: the failure's rank is known and its lines are its own (not a cascade);
        `cascade_at`: where the first collective timeout after the failure is, if any.
        """
        start = max((at for at in self.banners if at <= offset), default=-1)
        marks = [mark for mark in self.marks if mark.offset > start]
        before = [mark for mark in marks if mark.offset <= offset]
        reached = [mark for mark in marks if cascade_at is None or mark.offset <= cascade_at]
        own = [mark for mark in reached if mark.rank == rank]
        if own_lines and own:
            own_before = [mark for mark in own if mark.offset <= offset]
            return (own_before or own)[-1]
        if own_lines and reached:
            return reached[-1]
        if before:
            return before[-1]
        done = [mark for mark in self.done if mark.offset > start]
        after = [mark for mark in done if mark.offset > offset]
        return after[0] if after else (done[-1] if done else None)
