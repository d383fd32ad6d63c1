"""The bash reader: lossless tokens with spans, the parts of words, here-documents, arrays,
compound commands, and its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.importer.lexer import MAX_NESTING, Part, PartKind, Token, TokenKind, Word, tokenize
from daemon.importer.records import MAX_INPUT_CHARS, ImporterError
from daemon.importer.shell import Case, Chain, Command, Function, Group, If, Loop, parse


def covers(text: str, tokens: tuple[Token, ...]) -> bool:
    position = 0
    for token in tokens:
        if token.start != position:
            return False
        position = token.end
    return position == len(text)


def words(text: str) -> list[str]:
    return [text[t.start : t.end] for t in tokenize(text) if t.kind is TokenKind.WORD]


def only_command(text: str) -> Command:
    nodes = parse(text)
    assert len(nodes) == 1
    node = nodes[0]
    assert isinstance(node, Command)
    return node


def first_word(text: str) -> Word:
    token = next(t for t in tokenize(text) if t.word is not None)
    assert token.word is not None
    return token.word


def param(word: Word) -> Part:
    return next(part for part in word.parts if part.kind is PartKind.PARAM)


@pytest.mark.parametrize(
    "text",
    [
        "#!/bin/bash\n#SBATCH --nodes=2\npython train.py --bs 4 2>&1 | tee log\n",
        'export CMD=" \\\n    --lr 1e-4 \\\n    "\nsrun bash -c "$LAUNCHER $CMD"',
        'cat <<EOT > $f\n{\n  "a": $X\n}\nEOT\necho done',
        "declare -a A=(\n  --x=1 # one\n  --y=2\n)\n",
        "X='unterminated\n",
        "python t.py --batch_size 16\\\n    --lr 3\\\n",
        "a && b || c; d & e |& f >> g 2>&1 &>> h <<< i",
        "${X:-$(echo \"}\")} `date` $((1 + 2)) <(ls) $'a\\tb'",
        "if [[ $a == 1 && $b > 2 ]]; then x=1; elif true; then y; else z; fi",
    ],
)
def test_tokens_cover_the_text_exactly(text: str) -> None:
    tokens = tokenize(text)
    assert covers(text, tokens)
    assert "".join(text[t.start : t.end] for t in tokens) == text


def test_comments_directives_and_lookalikes_are_comment_tokens() -> None:
    text = "#SBATCH --nodes=2\n# SBATCH -N 4\n##SBATCH --gres=gpu:8\necho a # trailing\n"
    comments = [text[t.start : t.end] for t in tokenize(text) if t.kind is TokenKind.COMMENT]
    assert comments == ["#SBATCH --nodes=2", "# SBATCH -N 4", "##SBATCH --gres=gpu:8", "# trailing"]


def test_a_hash_inside_a_word_is_not_a_comment() -> None:
    assert words("echo a#b 'c # d'") == ["echo", "a#b", "'c # d'"]


def test_a_backslash_newline_glued_to_a_value_belongs_to_the_word() -> None:
    text = "python t.py --batch_size 16\\\n    --lr 3"
    word = next(t.word for t in tokenize(text) if t.word and text[t.start : t.end].startswith("16"))
    assert word is not None
    assert [part.kind for part in word.parts] == [PartKind.LITERAL, PartKind.CONTINUATION]
    assert words(text)[-2:] == ["--lr", "3"]


def test_a_continuation_between_words_is_its_own_token() -> None:
    kinds = [t.kind for t in tokenize("a \\\n  b")]
    assert kinds == [
        TokenKind.WORD,
        TokenKind.BLANK,
        TokenKind.CONTINUATION,
        TokenKind.BLANK,
        TokenKind.WORD,
    ]


def test_double_quotes_keep_expansions_and_escapes_as_parts() -> None:
    text = '"a $X \\$Y ${Z:-d} $(cmd "q") `b`"'
    word = first_word(text)
    assert [part.kind for part in word.parts] == [PartKind.DOUBLE_QUOTED]
    kinds = [part.kind for part in word.parts[0].children]
    assert kinds == [
        PartKind.QUOTED_TEXT,
        PartKind.PARAM,
        PartKind.QUOTED_TEXT,
        PartKind.QUOTED_ESCAPE,
        PartKind.QUOTED_TEXT,
        PartKind.PARAM,
        PartKind.QUOTED_TEXT,
        PartKind.COMMAND_SUB,
        PartKind.QUOTED_TEXT,
        PartKind.COMMAND_SUB,
    ]


def test_a_double_quoted_string_may_span_lines_and_hold_inner_quotes_that_restart_it() -> None:
    text = 'export CMD=" \\\n    --config_overrides "a=$N,b=2" \\\n    --x 1\n    "'
    assert words(text) == ["export", text[len("export ") :]]


@pytest.mark.parametrize(
    ("text", "name", "op", "operand"),
    [
        ("$X", "X", "", ""),
        ("${X}", "X", "", ""),
        ("${X:-/a/b}", "X", ":-", "/a/b"),
        ("${X-d}", "X", "-", "d"),
        ("${X:=8}", "X", ":=", "8"),
        ("${1:?usage: sbatch x <a|b>}", "1", ":?", "usage: sbatch x <a|b>"),
        ("${X:+--flag}", "X", ":+", "--flag"),
        ("$1", "1", "", ""),
        ("$@", "@", "", ""),
        ("${#X}", "X", "len", ""),
        ("${X##*/}", "X", "other", ""),
    ],
)
def test_parameter_expansions_are_read_with_name_operator_and_operand(
    text: str, name: str, op: str, operand: str
) -> None:
    part = param(first_word(text))
    assert (part.name, part.op) == (name, op)
    if part.children:
        assert text[part.children[0].start : part.children[-1].end] == operand


def test_array_subscripts_are_kept() -> None:
    part = param(first_word('"${ARGS[@]}"'.strip('"')))
    assert (part.name, part.index) == ("ARGS", "@")


def test_command_substitution_is_opaque_and_balanced() -> None:
    text = 'X=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1 # ) in a comment\n)'
    word = first_word(text)
    assert word.end == len(text)
    assert word.parts[-1].kind is PartKind.COMMAND_SUB


def test_arrays_with_comments_and_backslashes_are_one_word_with_elements() -> None:
    text = 'declare -a ARGS=(\n    --a=1 # one\n    --b $X \\\n    --c="q q" \\\n)\nnext'
    token = next(t for t in tokenize(text) if t.word and text[t.start :].startswith("ARGS"))
    assert token.word is not None
    array = token.word.parts[0]
    assert array.kind is PartKind.ARRAY
    assert [text[w.start : w.end] for w in array.elements] == ["--a=1", "--b", "$X", '--c="q q"']
    assert text[token.end :] == "\nnext"


def test_heredoc_bodies_follow_their_line_with_quoting_and_tab_stripping() -> None:
    text = "cat <<EOT > $f\nA $X\nEOT\ncat <<'RAW'\nB $Y\nRAW\ncat <<-END\n\tC\n\tEND\ntail"
    heredocs = [t.heredoc for t in tokenize(text) if t.heredoc is not None]
    assert [(h.delimiter, h.quoted, h.strip_tabs, h.terminated) for h in heredocs] == [
        ("EOT", False, False, True),
        ("RAW", True, False, True),
        ("END", False, True, True),
    ]
    bodies = [text[h.start : h.body_end] for h in heredocs]
    assert bodies == ["A $X\n", "B $Y\n", "\tC\n"]
    assert [p.kind for p in heredocs[0].parts] == [
        PartKind.QUOTED_TEXT,
        PartKind.PARAM,
        PartKind.QUOTED_TEXT,
    ]
    assert words(text)[-1] == "tail"


def test_an_unterminated_heredoc_runs_to_the_end() -> None:
    text = "read -r -d '' cmd <<EOF\npython t.py \\\n  --x=1\n"
    heredoc = next(t.heredoc for t in tokenize(text) if t.heredoc is not None)
    assert heredoc is not None
    assert not heredoc.terminated
    assert heredoc.body_end == len(text)


def test_in_a_heredoc_a_backslash_before_a_quote_stays() -> None:
    text = 'cat <<EOF\nk=\\"$V\\" \\\n&& x\nEOF\n'
    heredoc = next(t.heredoc for t in tokenize(text) if t.heredoc is not None)
    assert heredoc is not None
    kinds = [p.kind for p in heredoc.parts]
    assert PartKind.QUOTED_ESCAPE not in kinds
    assert PartKind.CONTINUATION in kinds


def test_redirections_pipes_and_lists_are_operators() -> None:
    text = "python t.py --x 1 2>&1 | tee -a log && echo done &>> j; a || b"
    operators = [text[t.start : t.end] for t in tokenize(text) if t.kind is TokenKind.OPERATOR]
    assert operators == ["2>&", "|", "&&", "&>>", ";", "||"]


def test_a_command_keeps_assignments_words_and_redirect_targets() -> None:
    command = only_command('A=1 B="x y" python t.py --x 2 > out.log 2>&1')
    text = 'A=1 B="x y" python t.py --x 2 > out.log 2>&1'
    assert [text[w.start : w.end] for w in command.assignments] == ["A=1", 'B="x y"']
    assert [text[w.start : w.end] for w in command.words] == ["python", "t.py", "--x", "2"]
    assert [
        (r.op, text[r.target.start : r.target.end] if r.target else None) for r in command.redirects
    ] == [(">", "out.log"), (">&", "1")]


def test_pipelines_and_lists_become_chains() -> None:
    nodes = parse("clear; srun x 2>&1 | tee -a log\ncd d && python t.py || exit 1\n")
    assert isinstance(nodes[0], Command)
    assert isinstance(nodes[1], Chain)
    assert nodes[1].ops == ("|",)
    assert isinstance(nodes[2], Chain)
    assert nodes[2].ops == ("&&", "||")


def test_compound_commands_are_parsed() -> None:
    text = (
        "if [[ $N == 1 ]]; then composer t.py; \nelse srun bash ./l.sh; fi\n"
        'case "$V" in\n  a) X=1; Y=2 ;;\n  *) exit 1 ;;\nesac\n'
        'for m in $M; do S="$S --m=$m"; done\n'
        "while read l; do echo $l; done\n"
        'main() { python t.py "$@"; }\n'
        "( cd x; make )\n"
        "{ a; b; } > log\n"
    )
    nodes = parse(text)
    kinds = [type(node) for node in nodes]
    assert kinds == [If, Case, Loop, Loop, Function, Group, Group]
    branch = nodes[0]
    assert isinstance(branch, If)
    assert len(branch.clauses) == 1
    assert branch.orelse is not None
    case = nodes[1]
    assert isinstance(case, Case)
    assert [len(item.body) for item in case.items] == [2, 1]
    loop = nodes[2]
    assert isinstance(loop, Loop)
    assert loop.variable == "m"
    function = nodes[4]
    assert isinstance(function, Function)
    assert function.name == "main"
    assert isinstance(nodes[5], Group)
    assert nodes[5].subshell
    assert isinstance(nodes[6], Group)
    assert not nodes[6].subshell


def test_operators_inside_double_brackets_do_not_split_the_command() -> None:
    nodes = parse("[[ -n $A && $B > 2 ]] && echo yes")
    assert isinstance(nodes[0], Chain)
    test = nodes[0].items[0]
    assert isinstance(test, Command)
    assert len(test.words) >= 3


def test_stray_keywords_and_operators_are_read_without_error() -> None:
    nodes = parse("fi\ndone\n)\n;; esac }\nthen echo x\n")
    assert all(isinstance(node, Command | Group | Chain) for node in nodes)


def test_input_over_the_size_limit_is_refused() -> None:
    with pytest.raises(ImporterError, match="over"):
        tokenize("#" * (MAX_INPUT_CHARS + 1))


def test_nul_bytes_are_refused() -> None:
    with pytest.raises(ImporterError, match="NUL"):
        tokenize("echo a\0b")


def test_nesting_beyond_the_cap_is_refused() -> None:
    deep = '"${X:-' * (MAX_NESTING + 2) + "x" + '}"' * (MAX_NESTING + 2)
    with pytest.raises(ImporterError, match="nested deeper"):
        tokenize(deep)


def test_nested_compound_commands_beyond_the_cap_are_refused() -> None:
    deep = "if true; then " * (MAX_NESTING + 2) + "x" + "; fi" * (MAX_NESTING + 2)
    with pytest.raises(ImporterError, match="nested deeper"):
        parse(deep)


def test_deep_opaque_brackets_are_refused_not_recursed() -> None:
    deep = "$(" + "(" * (MAX_NESTING + 2) + ")" * (MAX_NESTING + 2) + ")"
    with pytest.raises(ImporterError, match="nested deeper"):
        tokenize(deep)


SHELLISH = st.text(
    alphabet=st.sampled_from(list("ab =$\"'\\`(){}[]#;&|<>\n\t-:*@?!0123456789x")),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(SHELLISH)
def test_any_text_is_tokenized_losslessly_or_refused(text: str) -> None:
    try:
        tokens = tokenize(text)
        parse(text)
    except ImporterError:
        return
    assert covers(text, tokens)
    for token in tokens:
        if token.word is not None:
            assert token.word.start == token.start
            assert token.word.end == token.end
            for part in token.word.parts:
                assert token.start <= part.start <= part.end <= token.end
