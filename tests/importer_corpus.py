"""The sbatch corpus (`tests/data/real/sbatch`) and the importer's analysis of it.

Labels are read strictly into typed records. Each script is analysed the way the importer's
caller will do it: analyse, read the files the analysis asks for, analyse again. Here "read"
means: the corpus file that stands for the path (`config_files`, named `NNN-slug-<name>` where
the path ends in `<name>`); a path with no such file stays missing, as on a cluster where the
file is not there. The directory is a parameter: a held-out set kept outside the tree, laid out
the same way, is read with `load_labels(directory)`.
"""

from __future__ import annotations

import posixpath
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from daemon.importer import Analysis, ImporterError, Knob, KnobReading, Status, analyse
from daemon.importer.configs import ConfigFormat

SBATCH_DIR: Final = Path(__file__).parent / "data" / "real" / "sbatch"
RUNTIME: Final = "runtime"
MAX_ROUNDS: Final = 6  # analyse, read what it asks for, again: the corpus needs at most 3
# User mappings the labels' notes name for a script's own argparse flags (`--knob K=FLAG`).
NOTED_MAPPINGS: Final[Mapping[str, Mapping[str, Knob]]] = {
    "003-torchrun-fsdp-bash-arrays.sbatch": {
        "--train_batch_size": Knob.MICRO_BATCH,
        "--val_batch_size": Knob.EVAL_BATCH,
    },
}
_KNOB_KEYS: Final = frozenset({"value", "line", "in", "expr"})
_SCRIPT_KEYS: Final = frozenset(
    {
        "file",
        "source",
        "licence",
        "derived",
        "dialect",
        "config_files",
        "config_sources",
        "notes",
        "knobs",
    }
)


class LabelError(ValueError):
    """A labels file that does not follow its README."""


@dataclass(frozen=True)
class KnobLabel:
    knob: Knob
    value: str  # RUNTIME or the value
    line: str
    in_file: str | None  # the corpus file holding `line` when it is not the script
    expr: str | None


@dataclass(frozen=True)
class ScriptLabel:
    file: str
    dialect: str
    derived: bool
    config_files: tuple[str, ...]
    knobs: tuple[KnobLabel, ...]
    directory: Path = SBATCH_DIR  # where the script and its config files are

    def knob(self, knob: Knob) -> KnobLabel | None:
        return next((label for label in self.knobs if label.knob is knob), None)


def load_labels(directory: Path = SBATCH_DIR) -> tuple[ScriptLabel, ...]:
    document = tomllib.loads((directory / "labels.toml").read_text(encoding="utf-8"))
    scripts = []
    for entry in document["script"]:
        unknown = set(entry) - _SCRIPT_KEYS
        if unknown:
            raise LabelError(f"{entry.get('file')}: unknown keys {sorted(unknown)}")
        knobs = []
        for name, fields in entry["knobs"].items():
            if set(fields) - _KNOB_KEYS or "value" not in fields or "line" not in fields:
                raise LabelError(f"{entry['file']} {name}: keys {sorted(fields)}")
            knobs.append(
                KnobLabel(
                    Knob(name),
                    fields["value"],
                    fields["line"],
                    fields.get("in"),
                    fields.get("expr"),
                )
            )
        scripts.append(
            ScriptLabel(
                file=entry["file"],
                dialect=entry["dialect"],
                derived=bool(entry["derived"]),
                config_files=tuple(entry.get("config_files", ())),
                knobs=tuple(knobs),
                directory=directory,
            )
        )
    return tuple(scripts)


def read_text(name: str, directory: Path = SBATCH_DIR) -> str:
    return (directory / name).read_bytes().decode("utf-8", "surrogateescape")


def corpus_file_for(label: ScriptLabel, path: str) -> str | None:
    """The corpus file that stands for a path the script names."""
    stem = label.file.removesuffix(".sbatch")
    names = {config.removeprefix(stem + "-"): config for config in label.config_files}
    base = posixpath.basename(path)
    if base in names:
        return names[base]
    endings = [config for name, config in names.items() if base.endswith(name)]
    return endings[0] if len(endings) == 1 else None


@dataclass(frozen=True)
class Result:
    label: ScriptLabel
    analysis: Analysis | None
    failure: str | None
    given: Mapping[str, str]  # path the script names -> corpus file given for it


def analyse_script(label: ScriptLabel, knob_names: Mapping[str, Knob] | None = None) -> Result:
    text = read_text(label.file, label.directory)
    files: dict[str, str] = {}
    given: dict[str, str] = {}
    try:
        analysis = analyse(text, name=label.file, files=files, knob_names=knob_names)
        for _ in range(MAX_ROUNDS):
            new = False
            for path in analysis.files_wanted:
                corpus = corpus_file_for(label, path)
                if corpus is not None and path not in files:
                    files[path] = read_text(corpus, label.directory)
                    given[path] = corpus
                    new = True
            if not new:
                break
            analysis = analyse(text, name=label.file, files=files, knob_names=knob_names)
    except ImporterError as error:
        return Result(label, None, str(error), given)
    return Result(label, analysis, None, given)


def value_right(label: KnobLabel, reading: KnobReading) -> bool:
    if label.value == RUNTIME:
        return reading.status is Status.RUNTIME
    return reading.status is Status.FOUND and reading.value == label.value


def line_right(label: KnobLabel, reading: KnobReading, result: Result) -> bool:
    """The labelled line is among the lines the reading names (used, passed through, written)."""
    wanted_file = label.in_file or result.label.file
    for occurrence in reading.occurrences:
        for line in occurrence.lines():
            file = result.given.get(line.file, line.file)
            if line.text == label.line and file == wanted_file:
                return True
    return False


# ---------------------------------------------------------------- hostile inputs (issue 23)

# Each builds an input of about `size` characters from the characters one of the importer's
# readers could read in more than one way (the ambiguity a backtracking expression or a
# quadratic caller pays for); `tests/test_importer_hostile.py` reads them all and
# `tests/bench/bench_hostile.py` times some through the CLI.
Build = Callable[[int], str]
HEADER: Final = "#!/bin/bash\n#SBATCH -N 1\n"
# The reproducer: a script whose trailing `&&` joins nothing.
AND_AND_SCRIPT: Final = HEADER + "torchrun t.py --batch_size 4 && echo done &&\n"


def repeat(unit: str, size: int, head: str = "", tail: str = "") -> str:
    """`head`, `unit` as many times as fit in `size` characters, `tail`."""
    count = max(1, (size - len(head) - len(tail)) // len(unit))
    return head + unit * count + tail


def heredoc_script(path: str, body: str, command: str) -> str:
    """A script that writes `body` to `path` with a here-document, then runs `command`."""
    return f"{HEADER}cat > {path} <<EOF\n{body}\nEOF\n{command}\n"


def toml_bracket_script(size: int) -> str:
    """The issue's reproducer: a TOML line of `[` and blanks (cubic: 40 s at 6 KB)."""
    body = "[" + " " * (size - 80)
    return heredoc_script("c.toml", body, "torchrun t.py --config c.toml --batch_size 8")


def large_script(size: int) -> str:
    """A realistic large script of about `size` characters: an #SBATCH header, many exports
    and echo lines that use them, and one torchrun line with arguments."""
    lines = ["#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", ""]
    tail = (
        "torchrun --nnodes 2 --nproc_per_node 8 train.py --batch_size 4"
        " --gradient_accumulation_steps 8 --output_dir /ckpt/run1 --seq_len 2048\n"
    )
    length = sum(len(line) + 1 for line in lines) + len(tail)
    index = 0
    while length < size - 120:
        for line in (
            f"export VAR_{index}=value_{index}_with_some_padding_text",
            f'echo "step {index}: setting up $VAR_{index} in $HOME/run"',
        ):
            lines.append(line)
            length += len(line) + 1
        index += 1
    return "\n".join(lines) + "\n" + tail


def _exports_and_tests(size: int) -> str:
    """Many exported variables, each followed by a test the script cannot decide: a branch
    copied every variable (quadratic)."""
    lines, length, index = [HEADER], len(HEADER), 0
    while length < size - 60:
        line = f'export V{index}=x\nif [ -n "$A" ]; then X=1; fi\n'
        lines.append(line)
        length += len(line)
        index += 1
    return "".join(lines) + "torchrun t.py --batch_size $X\n"


# Config texts, by reader: the ambiguous runs of each of its expressions and scanners.
HOSTILE_CONFIGS: Final[Mapping[str, tuple[ConfigFormat, Build]]] = {
    "toml-bracket-blanks": (ConfigFormat.TOML, lambda n: "[" + " " * n),
    "toml-double-bracket-blanks": (ConfigFormat.TOML, lambda n: "[[" + " " * n + "x"),
    "toml-key-dots": (ConfigFormat.TOML, lambda n: repeat("a.", n)),
    "toml-key-dots-blanks": (ConfigFormat.TOML, lambda n: repeat("a . ", n)),
    "toml-key-blanks": (ConfigFormat.TOML, lambda n: "a" + " " * n),
    "toml-quotes": (ConfigFormat.TOML, lambda n: repeat('"', n)),
    "toml-quoted-dots": (ConfigFormat.TOML, lambda n: repeat('"a".', n)),
    "toml-deep-table": (
        ConfigFormat.TOML,
        lambda n: "[" + repeat("a.", n // 2) + "]\n" + repeat("x = 1\n", n // 2),
    ),
    "toml-open-strings": (ConfigFormat.TOML, lambda n: repeat('a = """\n', n)),
    "yaml-key-blanks": (ConfigFormat.YAML, lambda n: "a" + " " * n + "x"),
    "yaml-colons": (ConfigFormat.YAML, lambda n: repeat("a:", n)),
    "yaml-colon-blanks": (ConfigFormat.YAML, lambda n: repeat("a :", n)),
    "yaml-quote-backslashes": (ConfigFormat.YAML, lambda n: '"' + "\\" * n),
    "yaml-single-quotes": (ConfigFormat.YAML, lambda n: repeat("'", n)),
    "yaml-hash-blanks": (ConfigFormat.YAML, lambda n: "a: " + " #" * (n // 2)),
    "yaml-items": (ConfigFormat.YAML, lambda n: repeat("- ", n)),
    "yaml-list": (ConfigFormat.YAML, lambda n: repeat("- 1\n", n)),
    "yaml-nesting": (
        ConfigFormat.YAML,
        lambda n: "".join(" " * i + "a:\n" for i in range(min(n // 200, 400))),
    ),
    "json-brackets": (ConfigFormat.JSON, lambda n: "[" * (n // 2) + "]" * (n // 2)),
    "json-deep-list": (ConfigFormat.JSON, lambda n: "[" * 63 + repeat("1,", n) + "]" * 63),
    "json-backslashes": (ConfigFormat.JSON, lambda n: '"' + "\\" * n),
    "json-quotes": (ConfigFormat.JSON, lambda n: repeat('"', n)),
    "python-name-blanks": (ConfigFormat.PYTHON, lambda n: "a" + " " * n + "= 1"),
    "python-equals-blanks": (ConfigFormat.PYTHON, lambda n: "a =" + " " * n),
    "python-quotes": (ConfigFormat.PYTHON, lambda n: "a = " + '"' * n),
}

# Scripts for the whole analysis: the shell lexer and parser, the walk, and each config
# reader reached through a here-document the script writes.
HOSTILE_SCRIPTS: Final[Mapping[str, Build]] = {
    "toml-bracket-heredoc": toml_bracket_script,
    "yaml-key-blanks-heredoc": lambda n: heredoc_script(
        "c.yaml", "a" + " " * (n - 80) + "x", "torchrun t.py --config c.yaml"
    ),
    "json-backslashes-heredoc": lambda n: heredoc_script(
        "ds.json", '{"a": "' + "\\\\" * ((n - 100) // 2), "torchrun t.py --deepspeed ds.json"
    ),
    "python-blanks-heredoc": lambda n: heredoc_script(
        "c.py", "batch_size" + " " * (n - 100) + "= 4", "python train.py c.py"
    ),
    "yaml-interpolations": lambda n: heredoc_script(
        "c.yaml",
        "a0: 1\n"
        + "".join(f"a{i + 1}: " + f"${{a{i}}}" * 10 + "\n" for i in range(9))
        + "batch_size: "
        + "${a9}" * ((n - 800) // 5),
        "torchrun t.py --config c.yaml",
    ),
    "and-and-trailing": lambda n: repeat(
        "torchrun t.py --batch_size 4 && echo done &&\n", n, HEADER
    ),
    "and-and-chain": lambda n: repeat(
        "true && ", n, HEADER + "torchrun t.py --batch_size 4 && ", "\n"
    ),
    "pipes": lambda n: repeat("a | ", n, HEADER, "torchrun t.py\n"),
    "one-line-flags": lambda n: repeat(" --batch_size 4", n, HEADER + "torchrun t.py", "\n"),
    "continued-flags": lambda n: repeat(
        " --batch_size 4 \\\n", n, HEADER + "torchrun t.py \\\n", " --x 1\n"
    ),
    "command-substitutions": lambda n: repeat("$(", n, HEADER + "X="),
    "nested-substitutions": lambda n: HEADER + "X=" + "$(" * 30 + "a" * (n - 100) + ")" * 30 + "\n",
    "nested-defaults": lambda n: HEADER + "X=" + '"${A:-' * 30 + "a" * (n - 300) + '}"' * 30 + "\n",
    "open-braces": lambda n: repeat("${", n, HEADER + "echo "),
    "open-defaults": lambda n: repeat("${A:-", n, HEADER + "echo "),
    "double-quotes": lambda n: repeat('"', n, HEADER + "torchrun t.py "),
    "single-quotes": lambda n: repeat("'", n, HEADER + "torchrun t.py "),
    "backquotes": lambda n: repeat("`", n, HEADER + "torchrun t.py "),
    "ansi-quotes": lambda n: repeat("$'", n, HEADER + "torchrun t.py "),
    "escapes": lambda n: repeat("\\a", n, HEADER + "torchrun t.py "),
    "heredoc-markers": lambda n: repeat("cat <<EOF\n", n, HEADER),
    "heredoc-operators": lambda n: repeat(" <<A", n, HEADER + "cat", "\n"),
    "heredoc-expansions": lambda n: heredoc_script(
        "c.yaml", "$X" * ((n - 80) // 2), "torchrun t.py --config c.yaml"
    ),
    "digits": lambda n: repeat("1", n, HEADER + "echo "),
    "digit-redirections": lambda n: repeat("1>", n, HEADER + "echo "),
    "huge-number": lambda n: repeat("9", n, HEADER + "torchrun t.py --batch_size ", "\n"),
    "directive-lookalikes": lambda n: repeat("# SBATCH -N 1\n", n, HEADER),
    "directives": lambda n: repeat(" --nodes=2", n, "#!/bin/bash\n#SBATCH", "\n"),
    "placeholders": lambda n: repeat("{a", n, "#!/bin/bash\n#SBATCH --job-name="),
    "growing-value": lambda n: repeat('X="$X a"\n', n, HEADER, "torchrun t.py $X\n"),
    "growing-path": lambda n: repeat(
        'export PATH="$PATH:/opt/tools/bin"\n', n, HEADER, "torchrun t.py\n"
    ),
    "long-value-references": lambda n: repeat(
        " $Y", n, HEADER + "Y=" + "\\a" * 2000 + "\ntorchrun t.py", "\n"
    ),
    "exports-and-tests": _exports_and_tests,
    "many-launches": lambda n: repeat("torchrun t.py --batch_size 4\n", n, HEADER),
    "case-branches": lambda n: repeat(
        "a) X=1;;\n", n, HEADER + "case $Z in\n", "esac\ntorchrun t.py $X\n"
    ),
    "glob-tests": lambda n: repeat(
        '[[ "$A" == *a*a*a*b ]] && X=1\n', n, HEADER + "A=" + "a" * 500 + "\n"
    ),
    "functions": lambda n: repeat("f() { g; }\ng() { f; }\n", n, HEADER, "f\n"),
    "open-arrays": lambda n: repeat("A=(", n, HEADER),
    "array": lambda n: repeat(" a", n, HEADER + "A=(", ")\ntorchrun t.py ${A[@]}\n"),
    "evals": lambda n: repeat("eval ", n, HEADER, "true\n"),
    "missing-scripts": lambda n: HEADER + "".join(f"source a{i}.sh\n" for i in range(n // 16)),
    "eval-program-name": lambda n: repeat("_eval", n, HEADER + "python x", ".py --batch_size 4\n"),
    "lone-surrogate": lambda n: repeat("a", n, HEADER + "torchrun t.py --batch_size \ud800"),
    "newlines": lambda n: HEADER + "\n" * (n - 40) + "torchrun t.py\n",
}
