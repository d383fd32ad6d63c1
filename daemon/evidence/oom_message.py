"""An OOM message's text cut out of a log: from shortly before its trigger, with the lines that
continue a wrapped message joined to its first.

Apart from the figure readers (`oom`) because it is about lines, not numbers: real logs wrap a
message at a terminal's width or a viewer's, put the exception type alone on its line, and
follow it with other records (tests/data/real/oom/README.md). Each piece is bounded by
`MAX_MESSAGE_CHARS`, so a huge line can neither hide a message nor slow its parse.
"""

from __future__ import annotations

import re

from daemon.evidence.oom_family import TRIGGERS, XLA_WRAPPED
from daemon.evidence.records import OomFamily

MAX_MESSAGE_CHARS = 4096  # an OOM message is one long line; anything beyond is not its text
MESSAGE_LEAD_CHARS = 200  # kept before the first trigger: the exception type and prefixes
# The message's first line and those that may continue it: PyTorch 2.1's message hard-wrapped
# at 80 columns takes 8 lines (tests/data/real/oom/075), the exception type alone on its line
# one more (052).
MAX_BLOCK_LINES = 9

_OUT_OF_MEMORY_SENTENCE = re.compile(r"out of memory\.", re.IGNORECASE)
# The message's last words, by era: once they are in, a following line is not its text.
_TORCH_END = re.compile(
    r"PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF\b(?!=)"  # 1.11-2.1: "... Management and PYTORCH_..."
    r"|environment-variables\)"  # 2.2+: the hint's URL
    r"|unoccupied cached memory"  # XPU's hint
    r"|HIGH_WATERMARK_RATIO"  # MPS's hint
    r"|memory fraction\) ?: ?[0-9][0-9.]{0,40} ?(?:bytes|[KMGTPE]iB)"  # cudaMallocAsync's last
    r"|(?:cached|inactive|in total by PyTorch)\)[^\w\s]{0,3}\s*\Z"  # 1.0-1.10, no hint after
)


# A line that starts a record of its own, never the wrapped rest of a message.
_NEW_RECORD = re.compile(
    r"\s*\Z"
    r"|\s*(?:Traceback \(most recent call last\)|File \"|During handling of|The above exception"
    r"|Exception raised from|frame #[0-9]|```|\"\"\"|''')"
    r"|[0-9]{4}-[0-9]{2}-[0-9]{2}[ T_]"  # a timestamped record (logging, launchers)
    r"|[IWEF][0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2}"  # glog
    r"|(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL)\b"
    r"|\[[^\]\n]{0,64}\]"  # a bracketed prefix: another rank's `[rank12]:`, a `[timestamp]`
    r"|\([A-Za-z]\w{0,40} pid=[0-9]"  # a Ray or vLLM worker's `(RayWorkerWrapper pid=...`
)


def around_message(text: str) -> str:
    """The message and what follows it, bounded: a huge line must not hide or slow the parse."""
    starts = [match.start() for pattern in TRIGGERS if (match := pattern.search(text)) is not None]
    start = max(0, min(starts, default=0) - MESSAGE_LEAD_CHARS)
    return text[start : start + MAX_MESSAGE_CHARS]


def from_trigger(line: str) -> str:
    """The part of a line a message can be read from: from shortly before its trigger."""
    return around_message(line)


def message_lines(lines: list[str], family: OomFamily) -> list[str]:
    """The message's first line and the lines that continue it (a wrapped message)."""
    pieces = [from_trigger(lines[0])]
    if family not in (OomFamily.TORCH_ALLOCATOR, OomFamily.XLA):
        return pieces
    for line in lines[1:]:
        so_far = " ".join(pieces)
        if len(so_far) >= MAX_MESSAGE_CHARS or not _continues(so_far, line, family):
            break
        pieces.append(line[:MAX_MESSAGE_CHARS])
    return pieces


def _continues(so_far: str, line: str, family: OomFamily) -> bool:
    if _NEW_RECORD.match(line[:MAX_MESSAGE_CHARS]):
        return False
    if family is OomFamily.XLA:
        return XLA_WRAPPED.search(so_far) is not None
    if _TORCH_END.search(so_far):
        return False
    # a second "... out of memory." starts another message (a logger's copy of the first)
    return not (_OUT_OF_MEMORY_SENTENCE.search(line) and _OUT_OF_MEMORY_SENTENCE.search(so_far))


def joined_message(pieces: list[str], *, hard_wrapped: bool) -> str:
    """One line of text from a message's lines, as patterns can read it.

    Word-wrapping drops the space where it breaks a line, so lines are joined with one, except
    between two digits (a terminal broke a number: `31.7` / `5`), or everywhere when the
    message is taken as hard-wrapped. Markdown bold (`**17179869184.00 GiB**`) is dropped and
    runs of whitespace become one space.
    """
    text = pieces[0]
    for piece in pieces[1:]:
        split_number = text[-1:] in _NUMBER_CHARS and piece[:1] in _NUMBER_CHARS
        text += piece if hard_wrapped or split_number else f" {piece}"
    return " ".join(text.replace("**", "").split())[:MAX_MESSAGE_CHARS]


_NUMBER_CHARS = frozenset("0123456789.")
