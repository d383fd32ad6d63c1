"""Scalars of the config files training scripts point at, each with its span.

DeepSpeed and HF configs are JSON, accelerate/Composer/NeMo/torchtune/LLaMA-Factory/nanotron/
Lightning configs are YAML, torchtitan's are TOML, nanoGPT's are Python assignments. The
importer needs one thing from each: for every scalar, its key path and the exact span of its
text, so a value can be reported with its line and replaced in place. So these are small
tolerant line and token readers, not full parsers: they never execute or resolve anything
(no tags, anchors or merges), skip what they do not understand, accept `$VAR` where a
here-document left one, and read each file in one linear pass with a capped nesting depth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from daemon.importer.records import Form

MAX_CONFIG_DEPTH = 64


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
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"?')


def read_json(text: str) -> list[Entry]:
    """Every scalar of a JSON document; bare words (`$MICRO_BATCH_SIZE`, `auto`) are scalars."""
    entries: list[Entry] = []
    # Each open container: [path, is_object, next list index, key waiting for its value]
    stack: list[tuple[tuple[str, ...], bool]] = []
    indices: list[int] = []
    keys: list[str | None] = []
    pos, size = 0, len(text)
    while pos < size:
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
        match = (_JSON_STRING if char == '"' else _JSON_BARE).match(text, pos)
        end = match.end() if match else pos + 1
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


def _json_child(
    stack: list[tuple[tuple[str, ...], bool]], indices: list[int], keys: list[str | None]
) -> tuple[str, ...]:
    if not stack:
        return ()
    path, is_object = stack[-1]
    return (*path, (keys[-1] or "") if is_object else f"[{indices[-1]}]")


# ---------------------------------------------------------------- YAML

_YAML_KEY = re.compile(
    r"""(?P<key>"(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|[^\s#'"{}\[\],&*!|>%@`-][^#]*?|-[^\s#][^#]*?)"""
    r"""[ \t]*:(?=[ \t]|\Z)"""
)
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
            key = _YAML_KEY.match(rest)
            if key is None:
                entries.extend(_yaml_scalar(text, path, rest_column, rest))
                continue
            opened.append(_Open(indent + item.end(), path, item=True))
            stripped, indent, column = rest, indent + item.end(), rest_column
        key = _YAML_KEY.match(stripped)
        if key is None:
            continue
        while opened and (
            (not opened[-1].item and opened[-1].indent >= indent)
            or (opened[-1].item and opened[-1].indent > indent)
        ):
            opened.pop()
        if len(opened) >= MAX_CONFIG_DEPTH:
            continue
        path = (*(opened[-1].path if opened else ()), _unquote_key(key.group("key")))
        rest = stripped[key.end() :].lstrip(" \t")
        rest_column = column + len(stripped) - len(rest)
        if not rest or rest.startswith("#"):
            opened.append(_Open(indent, path, item=False))
            continue
        if rest[0] in "|>":
            block_indent = indent
            continue
        entries.extend(_yaml_scalar(text, path, rest_column, rest))
    return entries


def _lines(text: str) -> list[tuple[int, str]]:
    result = []
    position = 0
    for line in text.split("\n"):
        result.append((position, line))
        position += len(line) + 1
    return result


def _unquote_key(key: str) -> str:
    if len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"":
        return key[1:-1]
    return key.strip()


def _yaml_scalar(text: str, path: tuple[str, ...], column: int, rest: str) -> list[Entry]:
    """The scalar starting at `column` (whose line from there is `rest`)."""
    rest = rest.rstrip("\r")
    if rest[0] in "\"'":
        close = _closing_quote(rest, rest[0])
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

_TOML_TABLE = re.compile(r"\[\[?\s*(?P<name>[^\]]+?)\s*\]\]?")
_TOML_KEY = re.compile(
    r"(?P<key>(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
    r"(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*=\s*"
)


def read_toml(text: str) -> list[Entry]:
    """`key = value` scalars under their `[table]`; arrays, inline tables and multi-line
    strings are skipped whole."""
    entries: list[Entry] = []
    table: tuple[str, ...] = ()
    arrays: dict[tuple[str, ...], int] = {}
    skip_until: str | None = None
    for start, line in _lines(text):
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
        if header and stripped.startswith("["):
            names = tuple(_toml_key_parts(header.group("name")))
            if stripped.startswith("[["):
                number = arrays.get(names, 0)
                arrays[names] = number + 1
                names = (*names, f"[{number}]")
            table = names
            continue
        key = _TOML_KEY.match(stripped)
        if key is None:
            continue
        path = (*table, *_toml_key_parts(key.group("key")))
        rest = stripped[key.end() :]
        value_column = column + key.end()
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


def _toml_key_parts(key: str) -> list[str]:
    parts = re.findall(r"\"[^\"]*\"|'[^']*'|[^.\s]+", key)
    return [_unquote_key(part) for part in parts]


# ---------------------------------------------------------------- Python assignments

_PY_ASSIGN = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*(?=[^=])")


def read_python(text: str) -> list[Entry]:
    """Top-level `name = literal` lines of a config written as Python (nanoGPT's style)."""
    entries: list[Entry] = []
    for start, line in _lines(text):
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
