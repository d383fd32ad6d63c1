"""Text from users (log lines, job names, comments) made safe to print on a terminal.

A log line can carry escape sequences that move the cursor, retitle the window or rewrite
what was printed above it, and bidirectional overrides or zero-width characters that make
one name read as another. Every command's human output passes user text through
`printable`, which shows such characters as visible escapes (`\\x1b`, `\\u202e`) and keeps
newlines and tabs; `printable_json` does the same inside a JSON document, which stays
valid JSON with the same values.
"""

from __future__ import annotations

import json
import re
from typing import Any

# C0 controls but tab and newline, DEL and the C1 controls (0x9b is a one-byte CSI on some
# terminals); the bidirectional embeddings, overrides, isolates and marks; zero-width spaces
# and joiners, the word joiner and the byte-order mark; the line and paragraph separators.
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060\u2066-\u2069\ufeff]"
)


def printable(text: str) -> str:
    """`text` with every character that could act on the terminal shown as an escape."""
    return _UNSAFE.sub(_escape, text)


def printable_document(value: Any) -> Any:
    """Every string in a JSON-ready document (dicts, lists, keys too) through `printable`;
    tuples come back as lists, as they would from JSON."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_document(key): printable_document(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [printable_document(item) for item in value]
    return value


def printable_json(document: object) -> str:
    """The document as indented JSON that a terminal prints inertly.

    json.dumps escapes C0 controls itself; DEL, C1 and the Unicode characters above pass
    through raw with `ensure_ascii=False`, so they are written as `\\uXXXX` here, which
    JSON reads back as the same character.
    """
    text = json.dumps(document, indent=2, ensure_ascii=False, default=str)
    return _UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
