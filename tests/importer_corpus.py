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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from daemon.importer import Analysis, ImporterError, Knob, KnobReading, Status, analyse

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
