"""A small, bounded reader of the structure of bash as sbatch scripts are written.

`parse` groups the tokens of `lexer.tokenize` into commands, pipelines and the compound commands
(`if`, `case`, loops, groups, functions) the analysis needs to know which assignments always run.
The reader never executes anything. Malformed input (a stray `fi`, an unclosed `if`) is read
the way bash would get as far as it can, never rejected; nesting is capped at `MAX_NESTING`.

The tokens are read as they are needed and the script comes out one top-level command at a
time (`statements`), so a script's memory is that of its largest command, not of all its
tokens and commands at once (a script of 1 MB held some 200 MB of them); one top-level
command of over `MAX_STATEMENT_PARTS` words, operators and their parts is refused (`ImporterError`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from daemon.importer.lexer import (
    ASSIGN_PREFIX,
    MAX_NESTING,
    MAX_STATEMENT_PARTS,
    Heredoc,
    PartKind,
    Token,
    TokenKind,
    Word,
    significant_tokens,
)
from daemon.importer.records import ImporterError

_SIGNIFICANT = frozenset({TokenKind.WORD, TokenKind.OPERATOR, TokenKind.NEWLINE})

_CONTROL = frozenset({";", "&", "&&", "||", "|", "|&", ";;", ";&", ";;&", "(", ")"})
_CASE_ENDS = frozenset({";;", ";&", ";;&"})
_THEN_DO = frozenset({"then", "do"})
_ASSIGN_KINDS = frozenset({PartKind.LITERAL, PartKind.ARRAY})
_OPENERS = frozenset({"if", "case", "for", "while", "until", "select", "{", "function"})


class Body:
    """Where a `<<`'s here-document goes once it is read: after the line the redirection is
    on, so after the redirection itself."""

    __slots__ = ("heredoc",)

    def __init__(self) -> None:
        self.heredoc: Heredoc | None = None


_NO_BODY = Body()


@dataclass(frozen=True, slots=True)
class Redirect:
    op: str  # without its file-descriptor number
    start: int
    end: int
    target: Word | None
    body: Body = _NO_BODY  # a `<<`'s: filled when its body is read

    @property
    def heredoc(self) -> Heredoc | None:
        return self.body.heredoc


@dataclass(frozen=True, slots=True)
class Command:
    """A simple command: leading assignments, words, and redirections."""

    start: int
    end: int
    assignments: tuple[Word, ...]
    words: tuple[Word, ...]
    redirects: tuple[Redirect, ...]


@dataclass(frozen=True, slots=True)
class Chain:
    """Commands joined by `&&`, `||`, `|` or `|&`: `ops[i]` joins `items[i]` and `items[i+1]`."""

    start: int
    end: int
    items: tuple[Node, ...]
    ops: tuple[str, ...]
    background: bool = False


@dataclass(frozen=True, slots=True)
class If:
    start: int
    end: int
    clauses: tuple[tuple[tuple[Node, ...], tuple[Node, ...]], ...]  # (condition, body)
    orelse: tuple[Node, ...] | None


@dataclass(frozen=True, slots=True)
class CaseItem:
    patterns: tuple[Word, ...]
    body: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Case:
    start: int
    end: int
    subject: Word | None
    items: tuple[CaseItem, ...]


@dataclass(frozen=True, slots=True)
class Loop:
    start: int
    end: int
    keyword: str  # for, while, until, select
    variable: str  # for/select: the loop variable
    header: tuple[Node, ...]  # while/until: the condition
    body: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Group:
    start: int
    end: int
    body: tuple[Node, ...]
    subshell: bool


@dataclass(frozen=True, slots=True)
class Function:
    start: int
    end: int
    name: str
    body: tuple[Node, ...]


Node = Command | Chain | If | Case | Loop | Group | Function


class _Cursor:
    """The significant tokens (words, operators, newlines), read one at a time; here-document
    bodies are kept aside as they go by, for the redirections that name them."""

    def __init__(self, tokens: Iterable[Token], text: str) -> None:
        self.text = text
        self.bodies: dict[int, Body] = {}  # `<<`s read whose bodies have not come yet
        self.pos = 0  # tokens consumed: only grows, so a parser sees whether it moved
        self.previous: Token | None = None
        self.depth = 0
        self.batch_start = 0  # `weight` where the top-level commands not yet handed out begin
        self.weight = 0  # tokens and their parts read so far
        self._tokens = iter(tokens)
        self._buffer: deque[Token] = deque()

    def peek(self) -> Token | None:
        if not self._buffer and not self._pull():
            return None
        return self._buffer[0]

    def advance(self) -> None:
        token = self.peek()
        if token is None:
            return
        self.previous = self._buffer.popleft()
        self.pos += 1
        self._weigh(1 + token.weight)

    def body(self, ordinal: int) -> Body:
        """Where the body of the `<<` numbered `ordinal` will go."""
        return self.bodies.setdefault(ordinal, Body())

    def bodies_read(self) -> bool:
        """Whether the here-documents of the commands read so far are there: a body follows
        the newline of its line, so past that newline each one has been seen (or never comes)."""
        if not self.bodies:
            return True
        token = self.peek()
        if token is None:
            return True
        if token.kind is not TokenKind.NEWLINE:
            return False  # `cat <<EOF >f; echo` : the line goes on
        if len(self._buffer) == 1:
            self._pull()  # the token after the newline: the line's bodies come before it
        self.bodies.clear()
        return True

    def _weigh(self, weight: int) -> None:
        self.weight += weight
        if self.weight - self.batch_start > MAX_STATEMENT_PARTS:  # checked as it is read
            raise ImporterError(
                f"a command of over {MAX_STATEMENT_PARTS} words, operators and parts, not read"
            )

    def _pull(self) -> bool:
        for token in self._tokens:
            if token.heredoc is not None:
                self._weigh(token.weight)
                body = self.bodies.pop(token.ordinal, None)
                if body is not None:
                    body.heredoc = token.heredoc
            elif token.kind in _SIGNIFICANT:
                self._buffer.append(token)
                return True
        return False


def parse(text: str) -> tuple[Node, ...]:
    """The script as a list of top-level nodes (statements)."""
    return tuple(node for batch in statements(text) for node in batch)


def parse_tokens(text: str, tokens: Iterable[Token]) -> tuple[Node, ...]:
    return tuple(node for batch in _batches(text, tokens) for node in batch)


def statements(text: str) -> Iterator[tuple[Node, ...]]:
    """The script's top-level commands, a few at a time, read as they are asked for: each
    batch with the here-document bodies its redirections name."""
    return _batches(text, significant_tokens(text))


def _batches(text: str, tokens: Iterable[Token]) -> Iterator[tuple[Node, ...]]:
    cursor = _Cursor(tokens, text)
    cursor.depth = 1  # as inside `_statements`, which the top level once was
    batch: list[Node] = []
    while (token := cursor.peek()) is not None:
        if token.kind is TokenKind.NEWLINE or _op(cursor, token) in {";", "&"}:
            cursor.advance()
        else:
            before = cursor.pos
            node = _and_or(cursor, _never)
            if node is not None:
                batch.append(node)
            if cursor.pos == before:  # a token no statement starts with: skip it
                cursor.advance()
        if batch and cursor.bodies_read():
            yield tuple(batch)
            batch = []
        if not batch:
            cursor.batch_start = cursor.weight
    if batch:
        yield tuple(batch)


def _never(token: Token) -> bool:
    return False


def word_text(text: str, word: Word) -> str:
    return text[word.start : word.end]


def _peek(cursor: _Cursor) -> Token | None:
    return cursor.peek()


def _op(cursor: _Cursor, token: Token | None) -> str:
    if token is None or token.kind is not TokenKind.OPERATOR:
        return ""
    return cursor.text[token.start : token.end]


def _keyword(cursor: _Cursor, token: Token | None) -> str:
    """The reserved word a token is, when it could be one (a plain unquoted word)."""
    if token is None or token.word is None:
        return ""
    parts = token.word.parts
    if len(parts) != 1 or parts[0].kind is not PartKind.LITERAL:
        return ""
    return cursor.text[token.start : token.end]


def _skip_newlines(cursor: _Cursor) -> None:
    while (token := _peek(cursor)) is not None and (
        token.kind is TokenKind.NEWLINE or _op(cursor, token) == ";"
    ):
        cursor.advance()


def _statements(cursor: _Cursor, stop: Callable[[Token], bool]) -> list[Node]:
    """Statements until `stop` says a token ends the list (a `fi`, `done`, `)`...)."""
    cursor.depth += 1
    if cursor.depth > MAX_NESTING:
        raise ImporterError(f"compound commands nested deeper than {MAX_NESTING} levels")
    nodes: list[Node] = []
    while (token := _peek(cursor)) is not None:
        if token.kind is TokenKind.NEWLINE or _op(cursor, token) in {";", "&"}:
            cursor.advance()
            continue
        if stop(token):
            break
        before = cursor.pos
        node = _and_or(cursor, stop)
        if node is not None:
            nodes.append(node)
        if cursor.pos == before:
            break
    cursor.depth -= 1
    return nodes


def _and_or(cursor: _Cursor, stop: Callable[[Token], bool]) -> Node | None:
    items: list[Node] = []
    ops: list[str] = []
    first = cursor.peek()
    if first is None:
        return None
    start = first.start
    while True:
        node = _command(cursor, stop)
        if node is None:
            break
        items.append(node)
        op = _op(cursor, _peek(cursor))
        if op not in {"&&", "||", "|", "|&"}:
            break
        ops.append(op)
        cursor.advance()
        while (token := _peek(cursor)) is not None and token.kind is TokenKind.NEWLINE:
            cursor.advance()
    if not items:
        return None
    # `a && b &&` at the end of the script (or before a `fi`, a `)`...): bash would wait for
    # the command that never comes; the operator joins nothing and is dropped, so that a chain
    # keeps one operator between each two of its commands.
    del ops[len(items) - 1 :]
    background = _op(cursor, _peek(cursor)) == "&"
    if len(items) == 1 and not background:
        return items[0]
    end = _node_end(items[-1])
    return Chain(start, end, tuple(items), tuple(ops), background)


def _node_end(node: Node) -> int:
    return node.end


def _command(cursor: _Cursor, stop: Callable[[Token], bool]) -> Node | None:
    while _keyword(cursor, _peek(cursor)) == "!":  # negation changes no assignment
        cursor.advance()
    token = _peek(cursor)
    if token is None or stop(token):
        return None
    cursor.depth += 1
    try:
        if cursor.depth > MAX_NESTING:
            raise ImporterError(f"compound commands nested deeper than {MAX_NESTING} levels")
        return _command_at(cursor, stop, token)
    finally:
        cursor.depth -= 1


def _command_at(cursor: _Cursor, stop: Callable[[Token], bool], token: Token) -> Node | None:
    keyword = _keyword(cursor, token)
    if keyword in _OPENERS:
        node = _compound(cursor, keyword)
        _skip_redirects(cursor)
        return node
    if _op(cursor, token) == "(":
        cursor.advance()
        body = _statements(cursor, lambda t: _op(cursor, t) == ")")
        end = _close(cursor, lambda t: _op(cursor, t) == ")", token.end)
        _skip_redirects(cursor)
        return Group(token.start, end, tuple(body), subshell=True)
    return _simple(cursor, stop)


def _skip_redirects(cursor: _Cursor) -> None:
    """Redirections after a compound command (`done < file`, `} > log`) belong to it."""
    while (token := _peek(cursor)) is not None:
        op = _op(cursor, token)
        if not op or op in _CONTROL:
            return
        cursor.advance()
        if (target := _peek(cursor)) is not None and target.word is not None:
            cursor.advance()


def _close(cursor: _Cursor, closes: Callable[[Token], bool], fallback: int) -> int:
    """Consume the token that ends a compound command when it is there; its end offset."""
    token = _peek(cursor)
    if token is not None and closes(token):
        cursor.advance()
        return token.end
    previous = cursor.previous
    return previous.end if previous is not None else fallback


def _is_word(cursor: _Cursor, *words: str) -> Callable[[Token], bool]:
    return lambda token: _keyword(cursor, token) in words


def _compound(cursor: _Cursor, keyword: str) -> Node:
    token = cursor.peek()
    assert token is not None  # the caller read it as the keyword
    cursor.advance()
    if keyword == "if":
        return _if(cursor, token.start)
    if keyword == "case":
        return _case(cursor, token.start)
    if keyword in {"for", "select"}:
        return _for(cursor, token.start, keyword)
    if keyword in {"while", "until"}:
        header = _statements(cursor, _is_word(cursor, "do"))
        if _keyword(cursor, _peek(cursor)) == "do":
            cursor.advance()
        body = _statements(cursor, _is_word(cursor, "done"))
        end = _close(cursor, _is_word(cursor, "done"), token.end)
        return Loop(token.start, end, keyword, "", tuple(header), tuple(body))
    if keyword == "function":
        name_token = _peek(cursor)
        name = _keyword(cursor, name_token)
        if name:
            cursor.advance()
        _skip_parens(cursor)
        return _function_body(cursor, token.start, name.removesuffix("()"))
    body = _statements(cursor, _is_word(cursor, "}"))
    end = _close(cursor, _is_word(cursor, "}"), token.end)
    return Group(token.start, end, tuple(body), subshell=False)


def _skip_parens(cursor: _Cursor) -> None:
    if _op(cursor, _peek(cursor)) == "(":
        cursor.advance()
        if _op(cursor, _peek(cursor)) == ")":
            cursor.advance()


def _function_body(cursor: _Cursor, start: int, name: str) -> Node:
    _skip_newlines(cursor)
    body = _command(cursor, lambda token: False)
    nodes: tuple[Node, ...] = () if body is None else (body,)
    end = body.end if body is not None else start
    return Function(start, end, name, nodes)


def _if(cursor: _Cursor, start: int) -> Node:
    clauses: list[tuple[tuple[Node, ...], tuple[Node, ...]]] = []
    orelse: tuple[Node, ...] | None = None
    while True:
        condition = _statements(cursor, _is_word(cursor, "then"))
        if _keyword(cursor, _peek(cursor)) == "then":
            cursor.advance()
        body = _statements(cursor, _is_word(cursor, "elif", "else", "fi"))
        clauses.append((tuple(condition), tuple(body)))
        keyword = _keyword(cursor, _peek(cursor))
        if keyword == "elif":
            cursor.advance()
            continue
        if keyword == "else":
            cursor.advance()
            orelse = tuple(_statements(cursor, _is_word(cursor, "fi")))
        break
    end = _close(cursor, _is_word(cursor, "fi"), start)
    return If(start, end, tuple(clauses), orelse)


def _case(cursor: _Cursor, start: int) -> Node:
    subject_token = _peek(cursor)
    subject = subject_token.word if subject_token is not None else None
    if subject is not None:
        cursor.advance()
    _skip_newlines(cursor)
    if _keyword(cursor, _peek(cursor)) == "in":
        cursor.advance()
    items: list[CaseItem] = []
    while True:
        _skip_newlines(cursor)
        token = _peek(cursor)
        if token is None or _keyword(cursor, token) == "esac":
            break
        before = cursor.pos
        if _op(cursor, token) == "(":
            cursor.advance()
        patterns: list[Word] = []
        while (token := _peek(cursor)) is not None and _op(cursor, token) != ")":
            if token.word is not None:
                patterns.append(token.word)
            elif token.kind is TokenKind.NEWLINE:
                break
            cursor.advance()
        if _op(cursor, _peek(cursor)) == ")":
            cursor.advance()
        body = _statements(
            cursor, lambda t: _op(cursor, t) in _CASE_ENDS or _keyword(cursor, t) == "esac"
        )
        items.append(CaseItem(tuple(patterns), tuple(body)))
        if _op(cursor, _peek(cursor)) in _CASE_ENDS:
            cursor.advance()
        if cursor.pos == before:  # nothing read: step over the token so the loop ends
            cursor.advance()
    end = _close(cursor, _is_word(cursor, "esac"), start)
    return Case(start, end, subject, tuple(items))


def _for(cursor: _Cursor, start: int, keyword: str) -> Node:
    variable = ""
    token = _peek(cursor)
    if _op(cursor, token) == "(":  # for (( ...; ...; ... ))
        while (token := _peek(cursor)) is not None and token.kind is not TokenKind.NEWLINE:
            if _keyword(cursor, token) == "do":
                break
            cursor.advance()
    else:
        variable = _keyword(cursor, token)
        cursor.advance()
        while (token := _peek(cursor)) is not None and token.kind is not TokenKind.NEWLINE:
            if _op(cursor, token) == ";" or _keyword(cursor, token) == "do":
                break
            cursor.advance()
    _skip_newlines(cursor)
    if _keyword(cursor, _peek(cursor)) == "do":
        cursor.advance()
    body = _statements(cursor, _is_word(cursor, "done"))
    end = _close(cursor, _is_word(cursor, "done"), start)
    return Loop(start, end, keyword, variable, (), tuple(body))


def _simple(cursor: _Cursor, stop: Callable[[Token], bool]) -> Node | None:
    assignments: list[Word] = []
    words: list[Word] = []
    redirects: list[Redirect] = []
    first = _peek(cursor)
    if first is None:
        return None
    start = first.start
    end = start
    test_brackets = False
    while (token := _peek(cursor)) is not None:
        if token.kind is TokenKind.NEWLINE:
            break
        op = _op(cursor, token)
        if test_brackets and token.kind is TokenKind.OPERATOR:
            cursor.advance()  # inside [[ ]], `<`, `&&` and parentheses are not shell operators
            end = token.end
            continue
        if op in _CONTROL:
            if op == "(" and len(words) == 1 and not assignments:
                cursor.advance()
                _skip_parens_close(cursor)
                return _function_body(cursor, start, word_text(cursor.text, words[0]))
            break
        if op:
            cursor.advance()
            end = token.end
            redirect = _redirect(cursor, token, op)
            redirects.append(redirect)
            end = redirect.end
            continue
        word = token.word
        if word is None or (not words and not assignments and stop(token)):
            break
        raw = word_text(cursor.text, word)
        if words and raw in _THEN_DO and not test_brackets and _keyword(cursor, token):
            break
        cursor.advance()
        end = token.end
        if not words and word.parts[0].kind in _ASSIGN_KINDS and ASSIGN_PREFIX.match(raw):
            assignments.append(word)
            continue
        words.append(word)
        if len(words) == 1 and raw == "[[":
            test_brackets = True
        elif test_brackets and raw == "]]":
            test_brackets = False
    if not words and not assignments and not redirects:
        return None
    return Command(start, end, tuple(assignments), tuple(words), tuple(redirects))


def _skip_parens_close(cursor: _Cursor) -> None:
    if _op(cursor, _peek(cursor)) == ")":
        cursor.advance()


def _redirect(cursor: _Cursor, token: Token, op: str) -> Redirect:
    bare = op.lstrip("0123456789")
    target_token = _peek(cursor)
    target = target_token.word if target_token is not None else None
    if target is not None:
        cursor.advance()
    end = target.end if target is not None else token.end
    body = cursor.body(token.ordinal) if token.ordinal >= 0 else _NO_BODY
    return Redirect(bare, token.start, end, target, body)
