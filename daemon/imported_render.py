"""Rendering an imported template: each changed knob's new value spliced over its sites in the
user's script (formatted for the way the text there is read), the insertions added, and the
result analysed again to check that the new values read back and nothing else moved.

Apart from reading the script (`imported_reading`) because this is the only part that writes
the user's text: with no change the script comes back byte for byte (a config's original file
stays in use), and a changed config is written into its copy, which the rendered script writes
at run time as the job's user.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from typing import Final

from daemon.dialects.base import Dialect, Knobs, KnobValue, Role
from daemon.imported import COPY_DELIMITER, ImportedScript, SpliceError, Writing
from daemon.imported_reading import resume_place
from daemon.importer import Analysis, Form, ImporterError, Knob, Site, analyse
from daemon.importer.records import CONFIG_FORMS
from daemon.importer.vocabulary import ALLOC_CONF_VARIABLES, RESUME_NAMES, normalise
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist

# Where a patched copy is written at run time: the job's user's home, which every node of a
# cluster sees; the hash of the copies names the directory, so a revision's copy is its own.
COPY_ROOT: Final = "$HOME/.slurm-medic"
# Written as it is wherever a shell reads it, quoted or not: no blank, quote or expansion.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]+\Z")
_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\[\]-]{1,1024}\Z")
_YAML_PLAIN = re.compile(r"[A-Za-z_./][A-Za-z0-9_./:@%+,-]*\Z")
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"})
_BOOL_STYLES = (("True", "False"), ("TRUE", "FALSE"), ("1", "0"), ("yes", "no"), ("on", "off"))


def splice(dialect: Dialect, imported: ImportedScript, knobs: Knobs) -> str:
    """The script with these knobs: the original text where nothing changed."""
    changed = {
        name: value for name, value in knobs.items() if value != imported.values.get(name, value)
    }
    for name in changed:
        if name in imported.not_managed:
            raise SpliceError(
                f"{name} is not managed in this template: {imported.not_managed[name]}"
            )
    if not changed:
        return imported.text
    edits: list[tuple[int, int, str]] = []
    config_edits: dict[str, list[tuple[int, int, str]]] = {}  # config path -> its copy's edits
    header: list[str] = []  # lines added after the #SBATCH header, in this order
    arguments: list[str] = []  # words added at the end of the training command
    for name in (spec.name for spec in dialect.knobs):
        if name not in changed:
            continue
        managed = imported.managed[name]
        value = changed[name]
        if managed.writing is Writing.SITES:
            for site in managed.sites:
                edit = (site.start, site.end, write_value(value, site, managed.presence))
                if site.file == imported.file:
                    edits.append(edit)
                else:
                    config_edits.setdefault(site.file, []).append(edit)
        elif managed.writing is Writing.ENV:
            edits += _env_edits(imported, imported.values[name], value, header)
        elif managed.writing is Writing.EXCLUDE:
            nodes = ",".join(str(node) for node in value) if isinstance(value, tuple) else ""
            if managed.sites:
                edits.append((managed.sites[0].start, managed.sites[0].end, _directive(nodes)))
            elif nodes:
                header.insert(0, f"#SBATCH --exclude={_directive(nodes)}")
        elif managed.writing is Writing.RESUME_ENV:
            header.append(f"export {managed.flag}={shlex.quote(str(value))}")
        elif str(value):
            arguments += [managed.flag, str(value)]
    text = imported.text
    newline = "\r\n" if "\r\n" in text else "\n"
    if config_edits:
        copies, path_edits = _config_copies(imported, config_edits)
        header += copies
        edits += path_edits
    if header:
        insertion = imported.analysis.env_insertion
        assert insertion.offset is not None  # managed only where there is a place
        lead = newline if insertion.newline_before else ""
        block = lead + newline.join(header) + ("" if insertion.newline_before else newline)
        edits.append((insertion.offset, insertion.offset, block))
    if arguments:
        edits.append(_arguments_edit(imported, arguments))
    script = _apply(text, edits)
    problems = check_rendered(dialect, imported, knobs, script)
    if problems:
        raise SpliceError("the change does not read back as written: " + "; ".join(problems))
    return script


def _config_copies(
    imported: ImportedScript, config_edits: Mapping[str, list[tuple[int, int, str]]]
) -> tuple[list[str], list[tuple[int, int, str]]]:
    """The lines that write each patched config's copy at run time, and the edits that make the
    script name the copy where it named the original."""
    patched = {
        path: _apply(imported.configs[path].config.text, edits)
        for path, edits in sorted(config_edits.items())
    }
    digest = hashlib.sha256(json.dumps(sorted(patched.items())).encode()).hexdigest()[:16]
    directory = f"{COPY_ROOT}/{digest}"
    lines = [
        "# slurm-medic: patched copies of config files this script names (the originals are "
        "not changed)",
        f'mkdir -p "{directory}" || exit 1',
    ]
    edits: list[tuple[int, int, str]] = []
    for path, text in patched.items():
        carried = imported.configs[path]
        if COPY_DELIMITER in text:
            raise SpliceError(
                f"not managed: the patched {path} holds {COPY_DELIMITER}, which would end the "
                "heredoc that writes it"
            )
        target = f"{directory}/{posixpath.basename(carried.config.copy)}"
        body = text if text.endswith("\n") else text + "\n"
        lines.append(f"cat > \"{target}\" <<'{COPY_DELIMITER}' || exit 1\n{body}{COPY_DELIMITER}")
        for site in carried.path_sites:
            written = f'"{target}"' if site.form is Form.SHELL_WORD else target
            edits.append((site.start, site.end, written))
    return lines, edits


def _env_edits(
    imported: ImportedScript, old: KnobValue, new: KnobValue, header: list[str]
) -> list[tuple[int, int, str]]:
    before, after = dict(_pairs(old)), dict(_pairs(new))
    removed = sorted(set(before) - set(after))
    if removed:
        raise SpliceError(f"removing {', '.join(removed)} from the script is not supported")
    edits = []
    for variable, text in sorted(after.items()):
        if before.get(variable) == text:
            continue
        site = imported.env_sites.get(variable)
        if site is not None:
            edits.append((site.start, site.end, write_value(text, site, False)))
        else:
            header.append(f"export {variable}={shlex.quote(text)}")
    return edits


def _pairs(value: KnobValue) -> list[tuple[str, str]]:
    if not isinstance(value, tuple):
        return []
    return [(str(pair[0]), str(pair[1])) for pair in value if isinstance(pair, tuple)]


def _arguments_edit(imported: ImportedScript, words: list[str]) -> tuple[int, int, str]:
    launch = resume_place(imported.analysis, imported.file)
    if isinstance(launch, str):
        raise SpliceError(launch)
    insertion = launch.args_end
    assert insertion.offset is not None  # checked by resume_place
    if insertion.form is Form.SHELL_WORD:
        written = [shlex.quote(word) for word in words]
    else:
        unsafe = [word for word in words if not _SAFE_WORD.match(word)]
        if unsafe:
            raise SpliceError(
                f"{unsafe[0]!r} cannot be added inside the script's {insertion.form} command "
                "string safely: only words without blanks, quotes or `$` can"
            )
        written = words
    return insertion.offset, insertion.offset, " " + " ".join(written)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    ordered = sorted(edits, key=lambda edit: (edit[0], edit[1]))
    for first, second in itertools.pairwise(ordered):
        if second[0] < first[1]:
            raise SpliceError("two changes would be written over the same text")
    pieces: list[str] = []  # one join, not a copy of the whole script per edit
    cursor = 0
    for start, end, replacement in ordered:
        pieces += [text[cursor:start], replacement]
        cursor = end
    pieces.append(text[cursor:])
    return "".join(pieces)


def write_value(value: KnobValue, site: Site, presence: bool = False) -> str:
    """`value` as it must be written at `site` to be read back as itself."""
    if presence and site.text.startswith("-"):
        if value is True:
            return site.text
        raise SpliceError(
            f"{site.text} is turned on by its presence: slurm-medic does not remove flags"
        )
    if isinstance(value, tuple):
        raise SpliceError("a list cannot be written at one place")
    if site.form in CONFIG_FORMS:
        written = _config_scalar(site.form, value, site.text)
        if site.within is Form.HEREDOC:
            written = _escape(written, "\\$`")
        return written
    text = _bool_text(value, site.text) if isinstance(value, bool) else str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise SpliceError("a value with a line break cannot be written into the script")
    if site.form is Form.DIRECTIVE:
        return _directive(text)
    if _SAFE_WORD.match(text):
        return text
    if site.form is Form.SHELL_WORD:
        return shlex.quote(text)
    if site.form is Form.DOUBLE_QUOTED:
        return _escape(text, '\\$`"')
    if site.form is Form.HEREDOC:
        return _escape(text, "\\$`")
    if site.form is Form.ANSI_C:
        return _escape(text, "\\'")
    if "'" in text:
        raise SpliceError(f"{text!r} contains `'`, which cannot be written inside '...'")
    return text  # SINGLE_QUOTED, HEREDOC_LITERAL: taken as written


def _directive(text: str) -> str:
    if not _DIRECTIVE_VALUE.match(text):
        raise SpliceError(f"{text!r} cannot be written in an #SBATCH directive")
    return text


def _escape(text: str, characters: str) -> str:
    return "".join("\\" + char if char in characters else char for char in text)


def _bool_text(value: bool, original: str) -> str:
    plain = original.strip("'\"")
    for true, false in _BOOL_STYLES:
        if plain in (true, false):
            return true if value else false
    return "true" if value else "false"


def _config_scalar(form: Form, value: KnobValue, original: str) -> str:
    """A config scalar in `form`, quoted the way the original was when it was a string."""
    quote = original[:1] if original[:1] in {'"', "'"} else ""
    if isinstance(value, bool):
        plain = {Form.PYTHON: ("True", "False")}.get(form, ("true", "false"))[not value]
        if form is Form.YAML:
            plain = _bool_text(value, original)
    else:
        plain = str(value)
    if isinstance(value, bool | int) and not quote:
        return plain
    if quote == "'" and form is not Form.JSON:
        if form is Form.YAML:
            return "'" + plain.replace("'", "''") + "'"
        if "'" in plain:
            raise SpliceError(f"{plain!r} contains `'`, which cannot be written inside '...'")
        return "'" + plain + "'"
    plain_yaml = _YAML_PLAIN.match(plain) and plain.lower() not in _YAML_WORDS
    if form is Form.YAML and not quote and plain_yaml:
        return plain
    if form is Form.PYTHON and not quote:
        return repr(plain)
    return json.dumps(plain, ensure_ascii=True)


def check_rendered(
    dialect: Dialect, imported: ImportedScript, knobs: Knobs, script: str
) -> list[str]:
    """What is wrong with a rendered script: a changed knob that does not read back as its new
    value, or anything else the analysis reads that moved. Empty when the render is right."""
    files = {path: carried.config.text for path, carried in imported.configs.items()}
    try:
        again = analyse(script, name=imported.file, files=files, knob_names=imported.knob_names)
    except ImporterError as error:
        return [f"the rendered script cannot be analysed: {error}"]
    expected = {reading.knob: reading.value for reading in imported.analysis.knobs}
    for name, managed in imported.managed.items():
        value = knobs[name]
        if managed.source is not None and value != imported.values[name]:
            expected[managed.source] = _expected_text(value)
    problems = []
    for reading in again.knobs:
        if reading.knob is Knob.ALLOC_CONF:
            continue
        want = expected[reading.knob]
        if reading.value != want:
            moved = "moved" if want == imported.analysis.reading(reading.knob).value else "reads"
            problems.append(f"{reading.knob.value} {moved}: {want} -> {reading.value}")
    problems += _env_problems(again, imported, knobs)
    problems += _exclude_problems(dialect, again, imported, knobs)
    problems += _resume_problems(again, imported, knobs)
    return problems


def _expected_text(value: KnobValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _env_problems(again: Analysis, imported: ImportedScript, knobs: Knobs) -> list[str]:
    managed = next((m for m in imported.managed.values() if m.writing is Writing.ENV), None)
    if managed is None:
        return []
    wanted = {k: v for k, v in _pairs(knobs[managed.knob]) if k in ALLOC_CONF_VARIABLES}
    found = {
        occurrence.source: occurrence.value
        for occurrence in again.reading(Knob.ALLOC_CONF).occurrences
    }
    return [
        f"{variable} reads {found.get(variable)!r}, not {value!r}"
        for variable, value in wanted.items()
        if found.get(variable) != value
    ]


def _exclude_problems(
    dialect: Dialect, again: Analysis, imported: ImportedScript, knobs: Knobs
) -> list[str]:
    knob = dialect.knob_for(Role.EXCLUDE)
    if knob is None or knob not in imported.managed:
        return []
    wanted = knobs[knob]
    values = [d.value for d in again.directives if d.option == "exclude" and d.group == 0]
    try:
        nodes = tuple(expand_hostlist(values[0])) if len(values) == 1 else ()
    except SlurmParseError:
        nodes = ()
    if len(values) > 1 or nodes != wanted:
        return [f"the --exclude directive reads {values}, not {wanted}"]
    return []


def _resume_problems(again: Analysis, imported: ImportedScript, knobs: Knobs) -> list[str]:
    """A resume flag the analysis knows (`--resume_from_checkpoint`, `--load`) must reach the
    training command; others (`--load_dir`) go where the same insertion point put these."""
    problems = []
    for name, managed in imported.managed.items():
        if managed.writing is not Writing.RESUME_FLAG or not knobs[name]:
            continue
        if normalise(managed.flag.lstrip("-")) not in RESUME_NAMES:
            continue
        primary = [launch for launch in again.launches if launch.primary]
        if not any(managed.flag in launch.resume_flags for launch in primary):
            problems.append(f"{managed.flag} does not reach the training command")
    return problems
