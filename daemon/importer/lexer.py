"""A small, bounded, lossless tokenizer of bash as sbatch scripts are written.

`tokenize` cuts a script into tokens that cover it exactly, each with its span: blanks,
comments, line continuations, operators, words (with their quoting and expansions as parts)
and here-document bodies. Nothing is normalised or joined, so any part of the script can be
found again byte for byte; the parser (`shell`) groups the tokens into commands.

Only what sbatch scripts use is read closely; anything else stays opaque rather than wrong:
command substitutions, arithmetic and process substitutions are kept as single parts. It runs
in time linear in the input, refuses input over `MAX_INPUT_CHARS`, and caps nesting (quotes in
expansions in quotes...) at `MAX_NESTING`. Malformed input (an unterminated quote) is read the
way bash would get as far as it can, never rejected: only size, NUL bytes, characters with no
UTF-8 form, nesting depth and a word of over `MAX_STATEMENT_PARTS` parts raise `ImporterError`.
The parser reads `significant_tokens`, made as it asks for them. It stays one piece of some 600
lines: the word reader and its scanners of quotes and expansions share one position and one
nesting count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from daemon.importer.records import MAX_INPUT_CHARS, ImporterError

MAX_NESTING = 32  # quotes inside expansions inside quotes...: real scripts use 3 or 4
# Words, operators and the parts of each (quotes, expansions, escapes) in one top-level command
# or one here-document body: each is kept while its command is read (some 100 bytes a part).
MAX_STATEMENT_PARTS = 100_000


class TokenKind(StrEnum):
    WORD = "word"
    BLANK = "blank"  # spaces and tabs
    NEWLINE = "newline"
    CONTINUATION = "continuation"  # a backslash-newline between words
    COMMENT = "comment"  # from `#` to the end of the line, newline excluded
    OPERATOR = "operator"  # control and redirection operators
    HEREDOC = "heredoc"  # a here-document body and its delimiter line


class PartKind(StrEnum):
    LITERAL = "literal"  # unquoted text, read as written
    ESCAPE = "escape"  # `\x`: the character after the backslash
    CONTINUATION = "continuation"  # backslash-newline inside a word or a string: removed
    SINGLE_QUOTED = "single_quoted"  # '...'
    DOUBLE_QUOTED = "double_quoted"  # "..." (children: its parts)
    ANSI_C = "ansi_c"  # $'...'
    QUOTED_TEXT = "quoted_text"  # plain text inside "..." or an unquoted here-document
    QUOTED_ESCAPE = "quoted_escape"  # `\$` and the like inside "..." or a here-document
    PARAM = "param"  # $X, ${X}, ${X:-default} (children: the operand's parts)
    COMMAND_SUB = "command_sub"  # $(...) and `...`: opaque
    ARITH = "arith"  # $((...)): opaque
    PROCESS_SUB = "process_sub"  # <(...) and >(...): opaque
    ARRAY = "array"  # NAME=( ... ): `elements` are its words


@dataclass(frozen=True, slots=True)
class Part:
    kind: PartKind
    start: int
    end: int
    children: tuple[Part, ...] = ()
    name: str = ""  # PARAM: the parameter (`X`, `1`, `@`)
    op: str = ""  # PARAM: `:-`, `-`, `:=`, `=`, `:?`, `?`, `:+`, `+`, `len`, `other`, or ""
    index: str = ""  # PARAM: the subscript text of ${X[...]}
    elements: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Word:
    start: int
    end: int
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Heredoc:
    delimiter: str
    quoted: bool  # a quoted delimiter: the body is taken literally
    strip_tabs: bool  # `<<-`
    start: int  # first character of the body
    body_end: int  # end of the body (the delimiter line starts here)
    end: int  # end of the delimiter line, its newline excluded
    parts: tuple[Part, ...]  # the body's parts (one QUOTED_TEXT when quoted)
    terminated: bool


@dataclass(frozen=True, slots=True)
class Token:
    kind: TokenKind
    start: int
    end: int
    word: Word | None = None
    heredoc: Heredoc | None = None
    ordinal: int = -1  # pairs a `<<` operator with its body
    weight: int = 0  # the parts read for a word or a body: what the parser counts it as


_OPERATOR = re.compile(
    r"\d*(?:<<-|<<<|<<|<&|<>|<|>>|>&|>\||>)|&>>|&>|;;&|;;|;&|&&|\|\||\|&|[;&|()]"
)
_BLANKS = re.compile(r"[ \t]+")
_SPACE_RUN = re.compile(r"[ \t\n]*")
_PLAIN = {
    "unquoted": re.compile(r"[^ \t\n;&|<>()\\'\"$`]+"),
    "double": re.compile(r"[^\"\\$`]+"),
    "heredoc": re.compile(r"[^\\$`]+"),
    "brace": re.compile(r"[^}\\'\"$`]+"),
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD_ENDS = frozenset(" \t\n;&|<>)")  # after a plain run, the word ends (not at `(`: NAME=( )
_SPECIAL_PARAM = frozenset("@*#?$!-0123456789")
_PARAM_OPS = (":-", ":=", ":?", ":+", "##", "%%", "//", "^^", ",,", "-", "=", "?", "+")
ASSIGN_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?\+?=")
# Characters a backslash keeps its meaning before, per quoting context.
_DOUBLE_ESCAPES = frozenset('$`"\\\n')
_HEREDOC_ESCAPES = frozenset("$`\\\n")


class _Lexer:
    """Yields the tokens as it reads them; `significant`: only words, operators, newlines and
    here-document bodies (what the parser reads), not blanks, comments and continuations."""

    def __init__(self, text: str, *, significant: bool = False) -> None:
        self.text = text
        self.size = len(text)
        self.significant = significant
        self.pending: list[tuple[str, bool, bool, int]] = []  # delimiter, quoted, strip, ordinal
        self.heredocs = 0
        self.expect_delimiter: tuple[bool, int] | None = None

    def run(self) -> Iterator[Token]:
        text, size = self.text, self.size
        significant = self.significant
        pos = 0
        while pos < size:
            char = text[pos]
            if char in " \t":
                blanks = _BLANKS.match(text, pos)
                end = blanks.end() if blanks else pos + 1
                if not significant:
                    yield Token(TokenKind.BLANK, pos, end)
                pos = end
            elif char == "\n":
                yield Token(TokenKind.NEWLINE, pos, pos + 1)
                pos += 1
                if self.pending:
                    for token in self._bodies(pos):
                        yield token
                        pos = token.end
                elif significant:
                    pos = self._blank_lines(pos)
            elif char == "\\" and text.startswith("\n", pos + 1):
                if not significant:
                    yield Token(TokenKind.CONTINUATION, pos, pos + 2)
                pos += 2
            elif char == "#":
                newline = text.find("\n", pos)
                end = size if newline < 0 else newline
                if not significant:
                    yield Token(TokenKind.COMMENT, pos, end)
                pos = end
            else:
                operator = None
                if not (char in "<>" and text.startswith("(", pos + 1)):
                    operator = _OPERATOR.match(text, pos)
                token = (
                    self._word(pos) if operator is None else self._operator(pos, operator.group())
                )
                yield token
                pos = token.end

    def _blank_lines(self, pos: int) -> int:
        """Past the blank lines and comments after a newline: one NEWLINE stands for them all,
        as the parser reads it (a million newlines were a million tokens)."""
        text = self.text
        while True:
            run = _SPACE_RUN.match(text, pos)
            pos = run.end() if run else pos
            if not text.startswith("#", pos):
                return pos
            newline = text.find("\n", pos)
            if newline < 0:
                return self.size
            pos = newline

    def _operator(self, pos: int, op: str) -> Token:
        bare = op.lstrip("0123456789")
        ordinal = -1
        if bare in {"<<", "<<-"}:
            ordinal = self.heredocs
            self.heredocs += 1
            self.expect_delimiter = (bare == "<<-", ordinal)
        return Token(TokenKind.OPERATOR, pos, pos + len(op), ordinal=ordinal)

    def _word(self, pos: int) -> Token:
        plain = _PLAIN["unquoted"].match(self.text, pos)
        end = plain.end() if plain else pos
        if (
            end > pos
            and self.expect_delimiter is None
            and (end == self.size or self.text[end] in _WORD_ENDS)
        ):
            # A plain word (most are): one literal part, no reader needed.
            word = Word(pos, end, (Part(PartKind.LITERAL, pos, end),))
            return Token(TokenKind.WORD, pos, end, word=word, weight=1)
        reader = _WordReader(self.text, 0)
        word = reader.word(pos)
        if word.end == pos:  # a character no rule takes: keep it as a word of its own
            word = Word(pos, pos + 1, (Part(PartKind.LITERAL, pos, pos + 1),))
        if self.expect_delimiter is not None:
            strip, ordinal = self.expect_delimiter
            self.expect_delimiter = None
            raw = self.text[word.start : word.end]
            quoted = any(char in raw for char in "'\"\\")
            delimiter = re.sub(r"\\(.)|['\"]", lambda match: match.group(1) or "", raw)
            self.pending.append((delimiter, quoted, strip, ordinal))
        return Token(TokenKind.WORD, word.start, word.end, word=word, weight=reader.spent[0])

    def _bodies(self, pos: int) -> list[Token]:
        """Here-document bodies start on the line after their operator, in operator order."""
        tokens = []
        for delimiter, quoted, strip, ordinal in self.pending:
            token = self._body(pos, delimiter, quoted, strip, ordinal)
            tokens.append(token)
            pos = token.end
        self.pending = []
        return tokens

    def _body(self, start: int, delimiter: str, quoted: bool, strip: bool, ordinal: int) -> Token:
        text, pos = self.text, start
        body_end, end, terminated = self.size, self.size, False
        while pos < self.size:
            newline = text.find("\n", pos)
            line_end = self.size if newline < 0 else newline
            line = text[pos:line_end]
            if (line.lstrip("\t") if strip else line) == delimiter:
                body_end, end, terminated = pos, line_end, True
                break
            pos = line_end + 1
        reader = _WordReader(text, 0)
        if quoted:
            parts: tuple[Part, ...] = (Part(PartKind.QUOTED_TEXT, start, body_end),)
        else:
            parts = reader.quoted_parts(start, body_end, "heredoc")
        heredoc = Heredoc(delimiter, quoted, strip, start, body_end, end, parts, terminated)
        weight = reader.spent[0]
        return Token(TokenKind.HEREDOC, start, end, heredoc=heredoc, ordinal=ordinal, weight=weight)


class _WordReader:
    """Reads the parts of one word (or of a string) from a position; nesting is depth-capped."""

    def __init__(
        self, text: str, depth: int, limit: int | None = None, spent: list[int] | None = None
    ) -> None:
        if depth > MAX_NESTING:
            raise ImporterError(f"quotes and expansions nested deeper than {MAX_NESTING} levels")
        self.text = text
        self.size = len(text) if limit is None else limit
        self.depth = depth
        self.spent = [0] if spent is None else spent  # parts read, shared with nested readers

    def nested(self, limit: int | None = None) -> _WordReader:
        limit = self.size if limit is None else limit
        return _WordReader(self.text, self.depth + 1, limit, self.spent)

    def word(self, pos: int) -> Word:
        """An unquoted word from `pos` to the first blank or operator character."""
        text, size = self.text, self.size
        start = pos
        parts: list[Part] = []
        if text[pos] in "<>" and text.startswith("(", pos + 1, size):
            end = _skip_group(text, pos + 2, size)
            parts.append(Part(PartKind.PROCESS_SUB, pos, end))
            pos = end
        while pos < size:
            char = text[pos]
            if char == "(" and _array_start(text, start, pos, parts):
                element_part, pos = self._array(parts.pop(), pos)
                parts.append(element_part)
                break
            if char in " \t\n;&|<>()":
                break
            pos = self._part(parts, pos, "unquoted")
        return Word(start, pos, tuple(parts))

    def quoted_parts(self, start: int, end: int, mode: str) -> tuple[Part, ...]:
        """The parts of a double-quoted string's content or an unquoted here-document body."""
        parts: list[Part] = []
        pos = start
        bounded = _WordReader(self.text, self.depth, end, self.spent)
        while pos < end:
            pos = bounded._part(parts, pos, mode)
        return tuple(parts)

    def _part(self, parts: list[Part], pos: int, mode: str) -> int:
        self.spent[0] += 1  # at most one new part here: what a word weighs, nested ones too
        if self.spent[0] > MAX_STATEMENT_PARTS:
            raise ImporterError(f"a word of over {MAX_STATEMENT_PARTS} parts, not read")
        text = self.text
        char = text[pos]
        quoted = mode in {"double", "heredoc"}
        if char == "\\":
            return self._escape(parts, pos, mode)
        if char == "$":
            return self._dollar(parts, pos)
        if char == "`":
            end = _skip_backquote(text, pos + 1, self.size)
            parts.append(Part(PartKind.COMMAND_SUB, pos, end))
            return end
        if not quoted and char == "'":
            end = text.find("'", pos + 1, self.size)
            end = self.size if end < 0 else end + 1
            parts.append(Part(PartKind.SINGLE_QUOTED, pos, end))
            return end
        if not quoted and char == '"':
            close = _find_double_close(text, pos + 1, self.size)
            children = self.nested().quoted_parts(pos + 1, close, "double")
            end = min(close + 1, self.size)
            parts.append(Part(PartKind.DOUBLE_QUOTED, pos, end, children))
            return end
        plain = _PLAIN[mode].match(text, pos, self.size)
        end = plain.end() if plain else pos + 1
        kind = PartKind.QUOTED_TEXT if quoted else PartKind.LITERAL
        _append_text(parts, kind, pos, end)
        return end

    def _escape(self, parts: list[Part], pos: int, mode: str) -> int:
        text = self.text
        if pos + 1 >= self.size:
            _append_text(
                parts,
                PartKind.QUOTED_TEXT if mode != "unquoted" else PartKind.LITERAL,
                pos,
                pos + 1,
            )
            return pos + 1
        following = text[pos + 1]
        if following == "\n":
            parts.append(Part(PartKind.CONTINUATION, pos, pos + 2))
        elif mode in {"unquoted", "brace"}:
            parts.append(Part(PartKind.ESCAPE, pos, pos + 2))
        elif following in (_DOUBLE_ESCAPES if mode == "double" else _HEREDOC_ESCAPES):
            parts.append(Part(PartKind.QUOTED_ESCAPE, pos, pos + 2))
        else:
            _append_text(parts, PartKind.QUOTED_TEXT, pos, pos + 2)
        return pos + 2

    def _dollar(self, parts: list[Part], pos: int) -> int:
        text = self.text
        following = text[pos + 1] if pos + 1 < self.size else ""
        if following == "(":
            end = _skip_group(text, pos + 2, self.size)
            arith = text.startswith("((", pos + 1, self.size)
            parts.append(Part(PartKind.ARITH if arith else PartKind.COMMAND_SUB, pos, end))
            return end
        if following == "{":
            return self._brace(parts, pos)
        if following == "'":
            end = _find_ansi_close(text, pos + 2, self.size)
            parts.append(Part(PartKind.ANSI_C, pos, end))
            return end
        if following == '"':
            close = _find_double_close(text, pos + 2, self.size)
            children = self.nested().quoted_parts(pos + 2, close, "double")
            end = min(close + 1, self.size)
            parts.append(Part(PartKind.DOUBLE_QUOTED, pos, end, children))
            return end
        name = _NAME.match(text, pos + 1, self.size)
        if name:
            parts.append(Part(PartKind.PARAM, pos, name.end(), name=name.group()))
            return name.end()
        if following and following in _SPECIAL_PARAM:
            parts.append(Part(PartKind.PARAM, pos, pos + 2, name=following))
            return pos + 2
        _append_text(parts, PartKind.LITERAL, pos, pos + 1)
        return pos + 1

    def _brace(self, parts: list[Part], pos: int) -> int:
        """${...}: the name, an optional subscript and operator, and the operand's parts."""
        text = self.text
        cursor = pos + 2
        op = ""
        if text.startswith("#", cursor, self.size) and not text.startswith(
            "}", cursor + 1, self.size
        ):
            op, cursor = "len", cursor + 1
        elif text.startswith("!", cursor, self.size):
            op, cursor = "other", cursor + 1
        name_match = _NAME.match(text, cursor, self.size)
        if name_match:
            name, cursor = name_match.group(), name_match.end()
        elif cursor < self.size and text[cursor] in _SPECIAL_PARAM:
            digits = re.match(r"\d+", text[cursor : cursor + 12])
            name = digits.group() if digits else text[cursor]
            cursor += len(name)
        else:
            end = _skip_brace(text, cursor, self.size)
            parts.append(Part(PartKind.PARAM, pos, end, name="", op="other"))
            return end
        index = ""
        if text.startswith("[", cursor, self.size):
            close = text.find("]", cursor, self.size)
            if close < 0:
                end = _skip_brace(text, cursor, self.size)
                parts.append(Part(PartKind.PARAM, pos, end, name=name, op="other"))
                return end
            index, cursor = text[cursor + 1 : close], close + 1
        if text.startswith("}", cursor, self.size):
            parts.append(Part(PartKind.PARAM, pos, cursor + 1, name=name, op=op, index=index))
            return cursor + 1
        operator = next(
            (
                candidate
                for candidate in _PARAM_OPS
                if text.startswith(candidate, cursor, self.size)
            ),
            None,
        )
        if op or operator is None or operator in {"##", "%%", "//", "^^", ",,"}:
            end = _skip_brace(text, cursor, self.size)
            parts.append(Part(PartKind.PARAM, pos, end, name=name, op="other", index=index))
            return end
        cursor += len(operator)
        operand: list[Part] = []
        reader = self.nested()
        while cursor < self.size and text[cursor] != "}":
            cursor = reader._part(operand, cursor, "brace")
        end = min(cursor + 1, self.size)
        parts.append(Part(PartKind.PARAM, pos, end, tuple(operand), name, operator, index))
        return end

    def _array(self, prefix: Part, pos: int) -> tuple[Part, int]:
        """NAME=( word word # comment ... ): the elements, comments and newlines allowed."""
        text = self.text
        reader = self.nested()
        elements: list[Word] = []
        cursor = pos + 1
        while cursor < self.size:
            char = text[cursor]
            if char in " \t\n":
                cursor += 1
            elif char == "\\" and text.startswith("\n", cursor + 1):
                cursor += 2
            elif char == "#":
                newline = text.find("\n", cursor, self.size)
                cursor = self.size if newline < 0 else newline
            elif char == ")":
                cursor += 1
                break
            elif char in ";&|<>(":
                cursor += 1  # not valid inside an array; skipped as bash would complain
            else:
                element = reader.word(cursor)
                if element.end == cursor:
                    cursor += 1
                    continue
                elements.append(element)
                cursor = element.end
        array = Part(
            PartKind.ARRAY,
            prefix.start,
            cursor,
            name=text[prefix.start : prefix.end],
            elements=tuple(elements),
        )
        return array, cursor


def _append_text(parts: list[Part], kind: PartKind, start: int, end: int) -> None:
    if parts and parts[-1].kind is kind and parts[-1].end == start:
        parts[-1] = Part(kind, parts[-1].start, end)
    else:
        parts.append(Part(kind, start, end))


def _array_start(text: str, start: int, pos: int, parts: list[Part]) -> bool:
    if len(parts) != 1 or parts[0].kind is not PartKind.LITERAL:
        return False
    prefix = ASSIGN_PREFIX.fullmatch(text[start:pos])
    return prefix is not None


_DOUBLE_RUN = re.compile(r'[^"\\$`]*')  # what `_find_double_close` steps over at once
_ESCAPED_RUN = {"'": re.compile(r"[^\\']*"), "`": re.compile(r"[^\\`]*")}


def _find_double_close(text: str, pos: int, size: int) -> int:
    """The index of the `"` closing a string whose content starts at `pos` (or `size`)."""
    while pos < size:
        run = _DOUBLE_RUN.match(text, pos, size)
        pos = run.end() if run else pos
        if pos >= size:
            break
        char = text[pos]
        if char == '"':
            return pos
        if char == "\\":
            pos += 2
        elif char == "$" and text.startswith("(", pos + 1):
            pos = _skip_group(text, pos + 2, size)
        elif char == "$" and text.startswith("{", pos + 1):
            pos = _skip_brace(text, pos + 2, size)
        elif char == "`":
            pos = _skip_backquote(text, pos + 1, size)
        else:
            pos += 1
    return size


def _find_ansi_close(text: str, pos: int, size: int) -> int:
    while pos < size:
        run = _ESCAPED_RUN["'"].match(text, pos, size)
        pos = run.end() if run else pos
        if pos >= size:
            break
        if text[pos] == "\\":
            pos += 2
        elif text[pos] == "'":
            return pos + 1
        else:
            pos += 1
    return size


def _skip_backquote(text: str, pos: int, size: int) -> int:
    while pos < size:
        run = _ESCAPED_RUN["`"].match(text, pos, size)
        pos = run.end() if run else pos
        if pos >= size:
            break
        if text[pos] == "\\":
            pos += 2
        elif text[pos] == "`":
            return pos + 1
        else:
            pos += 1
    return size


def _skip_brace(text: str, pos: int, size: int) -> int:
    """The end of a ${...} whose inside starts at `pos`: braces balanced, quotes skipped."""
    return _skip_nested(text, pos, "}", size)


def _skip_group(text: str, pos: int, size: int) -> int:
    """The end of a $(...), $((...)) or <(...) whose inside starts at `pos`."""
    return _skip_nested(text, pos, ")", size)


def _skip_nested(text: str, pos: int, closer: str, size: int) -> int:
    """Scan to the bracket closing an opaque construct, iteratively: an explicit stack of what
    is open (brackets, quotes, backquotes) instead of recursion, capped like the rest."""
    stack = [closer]
    while pos < size:
        char = text[pos]
        top = stack[-1]
        if top == "'":
            end = text.find("'", pos, size)
            if end < 0:
                return size
            stack.pop()
            pos = end + 1
        elif char == "\\":
            pos += 2
        elif top == '"':
            if char == '"':
                stack.pop()
            elif char == "$" and text.startswith(("(", "{"), pos + 1):
                stack.append(")" if text[pos + 1] == "(" else "}")
                pos += 1
            elif char == "`":
                stack.append("`")
            pos += 1
        elif top == "`":
            if char == "`":
                stack.pop()
            pos += 1
        else:
            if char == top:
                stack.pop()
            elif char in "'\"`":
                stack.append(char)
            elif char == "(":
                stack.append(")")
            elif char == "{" and pos > 0 and text[pos - 1] == "$":
                stack.append("}")
            elif char == "#" and top == ")" and (pos == 0 or text[pos - 1] in " \t\n;"):
                newline = text.find("\n", pos, size)
                pos = size if newline < 0 else newline
                continue
            pos += 1
        if not stack:
            return pos
        if len(stack) > MAX_NESTING:
            raise ImporterError(f"brackets nested deeper than {MAX_NESTING} levels")
    return size


def input_problem(text: str) -> str | None:
    """Why `text` is not a text file an importer should read (too long, NUL bytes, a character
    with no UTF-8 form), or None. The last would raise UnicodeEncodeError where a site's byte
    offset is counted: text decoded with `surrogateescape` has only the surrogates that encode
    back (U+DC80 to U+DCFF), a caller's str may hold any."""
    if len(text) > MAX_INPUT_CHARS:
        return f"over {MAX_INPUT_CHARS} characters"
    if "\0" in text:
        return "NUL bytes: not a text file"
    if not text.isascii():
        try:
            text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as error:
            return f"character {error.start} has no UTF-8 form (a lone surrogate)"
    return None


def check_input(text: str, what: str) -> None:
    """Refuse what is not a text file an importer should read (`input_problem`)."""
    problem = input_problem(text)
    if problem is not None:
        raise ImporterError(f"{what}: {problem}, not read")


def tokenize(text: str) -> tuple[Token, ...]:
    """Tokens covering `text` exactly, in order (here-document bodies after their line)."""
    check_input(text, "script")
    return tuple(_Lexer(text).run())


def significant_tokens(text: str) -> Iterator[Token]:
    """What the parser reads of `text` (no blanks, comments, continuations), one token at a
    time: a script's tokens are never all held at once."""
    check_input(text, "script")
    return _Lexer(text, significant=True).run()
