"""Scalars of the config files training scripts point at, each with its span.

DeepSpeed and HF configs are JSON, accelerate/Composer/NeMo/torchtune/LLaMA-Factory/nanotron/
Lightning configs are YAML, torchtitan's are TOML, nanoGPT's are Python assignments. The
importer needs one thing from each: for every scalar, its key path and the exact span of its
text, so a value can be reported with its line and replaced in place. So these are small
tolerant line and token readers, not full parsers: they never execute or resolve anything
(no tags, anchors or merges), skip what they do not understand, accept `$VAR` where a
here-document left one, and read each file in one linear pass with a capped nesting depth.

The files are the user's and the daemon reading them runs as root, so every regular expression
here runs in time linear in its line, with constant memory: quantifiers only over single
character classes, never two adjacent ones that can take the same characters, never a repeated
group (Python's engine keeps a backtracking record per repetition: 60 to 150 bytes a character
of a long line). What a regular expression cannot say that way (a key that runs to the first
`: `, a string with escapes) is a small scanner in Python. At most `MAX_CONFIG_ENTRIES` scalars
are read from one file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from daemon.importer.records import Form

MAX_CONFIG_DEPTH = 64  # nesting, and the components of one (dotted) key path
MAX_CONFIG_ENTRIES = 20_000  # scalars read from one file: a real config has a few hundred


class ConfigFormat(StrEnum):
    JSON = "json"
    YAML = "yaml"
    TOML = "toml"
    PYTHON = "python"

    @property
    def form(self) -> Form:
        return Form(self.value)


@dataclass(frozen=True, slots=True)
class Entry:
    """One scalar: its key path, its text's span (quotes included), and its value's span."""

    path: tuple[str, ...]  # mapping keys from the root; list items as "[0]", "[1]"...
    start: int
    end: int
    value_start: int  # the value without quotes
    value_end: int
    value: str  # unquoted (escapes other than the quote character itself kept as written)
    quoted: bool


def format_of(path: str) -> ConfigFormat | None:
    lowered = path.lower()
    for suffix, found in (
        (".json", ConfigFormat.JSON),
        (".yaml", ConfigFormat.YAML),
        (".yml", ConfigFormat.YAML),
        (".toml", ConfigFormat.TOML),
        (".py", ConfigFormat.PYTHON),
    ):
        if lowered.endswith(suffix):
            return found
    return None


def read_config(text: str, config_format: ConfigFormat) -> list[Entry]:
    readers = {
        ConfigFormat.JSON: read_json,
        ConfigFormat.YAML: read_yaml,
        ConfigFormat.TOML: read_toml,
        ConfigFormat.PYTHON: read_python,
    }
    return readers[config_format](text)


# ---------------------------------------------------------------- JSON

_JSON_BARE = re.compile(r"[^\s,:{}\[\]\"]+")
_STRING_RUN = re.compile(r'[^"\\\n]*')  # a run of a double-quoted string without escapes


def read_json(text: str) -> list[Entry]:
    """Every scalar of a JSON document; bare words (`$MICRO_BATCH_SIZE`, `auto`) are scalars."""
    entries: list[Entry] = []
    # Each open container: [path, is_object, next list index, key waiting for its value]
    stack: list[tuple[tuple[str, ...], bool]] = []
    indices: list[int] = []
    keys: list[str | None] = []
    pos, size = 0, len(text)
    while pos < size and len(entries) < MAX_CONFIG_ENTRIES:
        char = text[pos]
        if char in " \t\r\n,:":
            if char == "," and stack:
                if stack[-1][1]:
                    keys[-1] = None
                else:
                    indices[-1] += 1
            pos += 1
            continue
        if char in "{[":
            if len(stack) >= MAX_CONFIG_DEPTH:
                break
            stack.append((_json_child(stack, indices, keys), char == "{"))
            indices.append(0)
            keys.append(None)
            pos += 1
            continue
        if char in "}]":
            if stack:
                stack.pop()
                indices.pop()
                keys.pop()
            pos += 1
            continue
        if char == '"':
            end = _json_string_end(text, pos)
        else:
            bare = _JSON_BARE.match(text, pos)
            end = bare.end() if bare else pos + 1
        raw = text[pos:end]
        quoted = raw.startswith('"')
        value_start, value_end = (pos + 1, end - (1 if raw.endswith('"') and end - pos > 1 else 0))
        if not quoted:
            value_start, value_end = pos, end
        is_key = bool(stack) and stack[-1][1] and keys[-1] is None
        if is_key:
            keys[-1] = text[value_start:value_end]
        else:
            path = _json_child(stack, indices, keys)
            value = text[value_start:value_end]
            entries.append(Entry(path, pos, end, value_start, value_end, value, quoted))
        pos = end
    return entries


def _json_string_end(text: str, pos: int) -> int:
    """The end of the JSON string opening at `pos`: after its closing quote; at the end of its
    line or of the text when it is not closed (or a backslash ends the line). A scanner, not
    `"(?:[^"\\\n]|\\.)*"`, whose repeated group costs memory per character."""
    size = len(text)
    cursor = pos + 1
    while True:
        match = _STRING_RUN.match(text, cursor)
        cursor = match.end() if match else cursor
        if cursor >= size:
            return size
        char = text[cursor]
        if char == '"':
            return cursor + 1
        if char == "\n" or cursor + 1 >= size or text[cursor + 1] == "\n":
            return cursor  # a newline, or a backslash with nothing it can escape
        cursor += 2  # a backslash and the character it escapes


def _json_child(
    stack: list[tuple[tuple[str, ...], bool]], indices: list[int], keys: list[str | None]
) -> tuple[str, ...]:
    if not stack:
        return ()
    path, is_object = stack[-1]
    return (*path, (keys[-1] or "") if is_object else f"[{indices[-1]}]")


# ---------------------------------------------------------------- YAML

_YAML_NOT_KEY_START = frozenset("#'\"{}[],&*!|>%@`-")  # indicators: no plain key starts so
_BLANKS = re.compile(r"[ \t]*")
_KEY_RUN = re.compile(r'[^"\\]*')  # a run of a double-quoted key without escapes
_YAML_ITEM = re.compile(r"-(?=[ \t]|\Z)[ \t]*")


@dataclass
class _Open:
    indent: int
    path: tuple[str, ...]
    item: bool  # a mapping inside a list item: its keys sit at exactly `indent`


def read_yaml(text: str) -> list[Entry]:
    """Scalars of block-style YAML; flow collections and block scalars are kept whole."""
    entries: list[Entry] = []
    opened: list[_Open] = []
    counters: dict[tuple[str, ...], int] = {}
    block_indent: int | None = None  # inside a `|` or `>` block scalar deeper than this
    for start, line in _lines(text):
        if len(entries) >= MAX_CONFIG_ENTRIES:
            break
        content = line.rstrip("\r")
        stripped = content.lstrip(" \t")
        indent = len(content) - len(stripped)
        if block_indent is not None:
            if not stripped or indent > block_indent:
                continue
            block_indent = None
        if not stripped or stripped.startswith("#"):
            continue
        if indent == 0 and stripped.startswith(("---", "...")):
            opened.clear()
            continue
        column = start + indent
        path: tuple[str, ...]
        item = _YAML_ITEM.match(stripped)
        if item:
            while opened and (
                (not opened[-1].item and opened[-1].indent > indent)
                or (opened[-1].item and opened[-1].indent >= indent)
            ):
                opened.pop()
            if len(opened) >= MAX_CONFIG_DEPTH:
                continue
            owner = opened[-1].path if opened else ()
            number = counters.get(owner, 0)
            counters[owner] = number + 1
            path = (*owner, f"[{number}]")
            rest = stripped[item.end() :]
            rest_column = column + item.end()
            if not rest or rest.startswith("#"):
                opened.append(_Open(indent, path, item=False))
                continue
            key = yaml_key(rest)
            if key is None:
                entries.extend(_yaml_scalar(text, path, rest_column, rest))
                continue
            opened.append(_Open(indent + item.end(), path, item=True))
            stripped, indent, column = rest, indent + item.end(), rest_column
        key = yaml_key(stripped)
        if key is None:
            continue
        while opened and (
            (not opened[-1].item and opened[-1].indent >= indent)
            or (opened[-1].item and opened[-1].indent > indent)
        ):
            opened.pop()
        if len(opened) >= MAX_CONFIG_DEPTH:
            continue
        path = (*(opened[-1].path if opened else ()), _unquote_key(key[0]))
        rest = stripped[key[1] :].lstrip(" \t")
        rest_column = column + len(stripped) - len(rest)
        if not rest or rest.startswith("#"):
            opened.append(_Open(indent, path, item=False))
            continue
        if rest[0] in "|>":
            block_indent = indent
            continue
        entries.extend(_yaml_scalar(text, path, rest_column, rest))
    return entries


def yaml_key(line: str) -> tuple[str, int] | None:
    r"""The key of a `key: value` line (quotes kept) and the end of its colon, or None.

    A quoted key ends at its closing quote; a plain one runs to the first `:` followed by a
    blank or the end of the line and never past a `#`, blanks before the colon not part of it.
    Scanned with `str.find`: the expression this replaces, `[^#]*?[ \t]*:(?=[ \t]|\Z)`, let
    its lazy run and the blanks take a run of blanks in every split, quadratic in the line."""
    if not line:
        return None
    first = line[0]
    if first in "\"'":
        close = _key_quote_end(line, first)
        if close < 0:
            return None
        colon = _BLANKS.match(line, close + 1)
        after = (colon.end() if colon else close + 1) + 1
        if not line.startswith(":", after - 1) or not _blank_or_end(line, after):
            return None
        return line[: close + 1], after
    if first == "-":
        if len(line) < 2 or line[1].isspace() or line[1] == "#":
            return None
        begin = 2
    elif first.isspace() or first in _YAML_NOT_KEY_START:
        return None
    else:
        begin = 1
    comment = line.find("#", begin)
    limit = len(line) if comment < 0 else comment
    colon_at = line.find(":", begin, limit)
    while colon_at >= 0:
        if _blank_or_end(line, colon_at + 1):
            key_end = colon_at
            while key_end > begin and line[key_end - 1] in " \t":
                key_end -= 1
            return line[:key_end], colon_at + 1
        colon_at = line.find(":", colon_at + 1, limit)
    return None


def _blank_or_end(line: str, index: int) -> bool:
    return index == len(line) or line[index] in " \t"


def _key_quote_end(line: str, quote: str) -> int:
    """The index of the quote closing a quoted key, or -1: in "...", a backslash escapes the
    next character; in '...', a quote is written twice."""
    index = 1
    if quote == '"':
        while True:
            run = _KEY_RUN.match(line, index)
            index = run.end() if run else index
            if index >= len(line):
                return -1
            if line[index] == '"':
                return index
            if index + 1 >= len(line):
                return -1
            index += 2  # a backslash and the character it escapes
    while True:
        found = line.find("'", index)
        if found < 0:
            return -1
        run_end = found
        while run_end < len(line) and line[run_end] == "'":
            run_end += 1
        if (run_end - found) % 2:  # pairs are quotes written twice; the odd one closes
            return run_end - 1
        index = run_end


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """Each line with the offset it starts at, one at a time (no list of a million lines)."""
    position = 0
    size = len(text)
    while position <= size:
        newline = text.find("\n", position)
        end = size if newline < 0 else newline
        yield position, text[position:end]
        position = end + 1


def _unquote_key(key: str) -> str:
    if len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"":
        return key[1:-1]
    return key.strip()


def _yaml_scalar(text: str, path: tuple[str, ...], column: int, rest: str) -> list[Entry]:
    """The scalar starting at `column` (whose line from there is `rest`)."""
    rest = rest.rstrip("\r")
    if rest[0] in "\"'":
        close = _closing_quote(rest, rest[0])
        if close == 0:  # a lone quote ends the line: an empty string, not a span ending before it
            return [Entry(path, column, column + 1, column + 1, column + 1, "", True)]
        end = column + close + 1
        return [Entry(path, column, end, column + 1, end - 1, text[column + 1 : end - 1], True)]
    comment = re.search(r"[ \t]#", rest)
    value = (rest[: comment.start()] if comment else rest).rstrip(" \t")
    end = column + len(value)
    return [Entry(path, column, end, column, end, value, False)]


def _closing_quote(rest: str, quote: str) -> int:
    index = 1
    while index < len(rest):
        char = rest[index]
        if quote == '"' and char == "\\":
            index += 2
            continue
        if char == quote:
            if quote == "'" and rest.startswith("''", index):
                index += 2
                continue
            return index
        index += 1
    return len(rest) - 1


# ---------------------------------------------------------------- TOML

# `[name]` or `[[name]]`: one scan to the first `]` (the name is stripped in Python). It was
# `\[\[?\s*([^\]]+?)\s*\]\]?`, whose blanks, lazy name and blanks again took a run of blanks
# in every split: cubic in the line (6,000 blanks after `[` cost 40 seconds).
_TOML_TABLE = re.compile(r"\[(?P<name>[^\]\n]*)\]")
# One component of a dotted key; the dots and blanks between are read in Python: a repeated
# group `(?:\s*\.\s*part)*` kept a backtracking record per component (150 MB for a 1 MB line).
_TOML_KEY_PART = re.compile(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""")
_TOML_PATH_PART = re.compile(r"\"[^\"]*\"|'[^']*'|[^.\s]+")
_SPACES = re.compile(r"\s*")


def read_toml(text: str) -> list[Entry]:
    """`key = value` scalars under their `[table]`; arrays, inline tables and multi-line
    strings are skipped whole."""
    entries: list[Entry] = []
    table: tuple[str, ...] | None = ()  # None: under a table whose name is too deep to read
    arrays: dict[tuple[str, ...], int] = {}
    skip_until: str | None = None
    for start, line in _lines(text):
        if len(entries) >= MAX_CONFIG_ENTRIES:
            break
        content = line.rstrip("\r")
        if skip_until is not None:
            if skip_until in content:
                skip_until = None
            continue
        stripped = content.lstrip(" \t")
        column = start + len(content) - len(stripped)
        if not stripped or stripped.startswith("#"):
            continue
        header = _TOML_TABLE.match(stripped)
        if header and header.group("name"):
            name = header.group("name")
            double = stripped.startswith("[[")  # `[[name]]`: the scan stopped at its first `]`
            names = _toml_key_parts(name[1:] if double and len(name) > 1 else name)
            if names is None:
                table = None  # too deep a path: its keys are not read
                continue
            if double:
                number = arrays.get(names, 0)
                arrays[names] = number + 1
                names = (*names, f"[{number}]")
            table = names
            continue
        key = _toml_key(stripped)
        if key is None or table is None:
            continue
        parts = _toml_key_parts(stripped[: key[0]])
        if parts is None or len(table) + len(parts) > MAX_CONFIG_DEPTH:
            continue
        path = (*table, *parts)
        rest = stripped[key[1] :]
        value_column = column + key[1]
        for opener in ('"""', "'''"):
            if rest.startswith(opener) and rest.count(opener) < 2:
                skip_until = opener
        if skip_until is not None or not rest:
            continue
        if rest[0] in "[{":
            if rest.count(rest[0]) > rest.count("]" if rest[0] == "[" else "}"):
                skip_until = "]" if rest[0] == "[" else "}"
            continue
        entries.extend(_yaml_scalar(text, path, value_column, rest))
    return entries


def _toml_key(line: str) -> tuple[int, int] | None:
    """`a.b."c" = ` at the start of `line`: where the key ends and where its value starts;
    None when it is no key or has more than `MAX_CONFIG_DEPTH` components."""
    part = _TOML_KEY_PART.match(line)
    if part is None:
        return None
    key_end = part.end()
    for _ in range(MAX_CONFIG_DEPTH):
        blanks = _SPACES.match(line, key_end)
        cursor = blanks.end() if blanks else key_end
        if line.startswith("=", cursor):
            after = _SPACES.match(line, cursor + 1)
            return key_end, after.end() if after else cursor + 1
        if not line.startswith(".", cursor):
            return None
        blanks = _SPACES.match(line, cursor + 1)
        part = _TOML_KEY_PART.match(line, blanks.end() if blanks else cursor + 1)
        if part is None:
            return None
        key_end = part.end()
    return None  # more components than a path is read to


def _toml_key_parts(key: str) -> tuple[str, ...] | None:
    """The components of a dotted key or table name; None past `MAX_CONFIG_DEPTH` of them."""
    parts: list[str] = []
    for part in _TOML_PATH_PART.finditer(key):
        if len(parts) >= MAX_CONFIG_DEPTH:
            return None
        parts.append(_unquote_key(part.group()))
    return tuple(parts)


# ---------------------------------------------------------------- Python assignments

_PY_ASSIGN = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*(?=[^=])")


def read_python(text: str) -> list[Entry]:
    """Top-level `name = literal` lines of a config written as Python (nanoGPT's style)."""
    entries: list[Entry] = []
    for start, line in _lines(text):
        if len(entries) >= MAX_CONFIG_ENTRIES:
            break
        assignment = _PY_ASSIGN.match(line)
        if assignment is None:
            continue
        rest = line[assignment.end() :].rstrip("\r")
        if not rest or rest[0] in "([{":
            continue
        entries.extend(
            _yaml_scalar(text, (assignment.group("name"),), start + assignment.end(), rest)
        )
    return entries
