"""The report of `slurm-medic template analyse`: what the importer reads in a script, for a person.

Two halves. `gather` runs the importer's loop with the caller's reader: analyse the script,
read the files the analysis asks for (a DeepSpeed or accelerate config beside it, a YAML by
path), analyse again, until nothing new is wanted or the rounds run out; every file keeps its
outcome (read, missing, refused and why), so a knob left "set at run time" by a file that was
not there says which file. `report_document` turns the result into one JSON-ready document and
`report_lines` prints that same document for a terminal, so `--json` and the text never say
different things. After `template import`, `import_document` adds the template that was
written: each of its dialect's knobs, managed (its value and where a change is written) or not
managed and why, and the verdict is then about what the template manages.

The verdict names the four things a batch-size remediation needs: the micro-batch and the
accumulation it trades against each other, the global batch it must keep, and the checkpoint
directory it resumes from. A term is known when the script writes it, or when the others imply
it (a written global batch fixes the accumulation in the frameworks that take one; a written
micro-batch and accumulation fix the global batch for a given world size); never from a
default.
"""

from __future__ import annotations

import json
import posixpath
import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from daemon.commands.terminal import printable
from daemon.dialects.base import KnobValue, Role
from daemon.importer import (
    Analysis,
    Basis,
    ImporterError,
    Insertion,
    Knob,
    KnobReading,
    Launch,
    Line,
    Occurrence,
    Site,
    Status,
    analyse,
)
from daemon.importer.records import MAX_INPUT_CHARS
from daemon.owner_files import Owner, OwnerFiles, OwnerReadRefused, Refusal, RefusalKind
from daemon.templates import LaunchTemplate, invariant_known, knobs_to_json

MAX_ROUNDS: Final = 6  # analyse, read what it asks for, again; the real corpus needs at most 3
MAX_FILES: Final = 64  # files read besides the script; a real script names a handful
MAX_FILE_BYTES: Final = MAX_INPUT_CHARS  # what the analysis accepts of one file
SHOWN_LINE_CHARS: Final = 160  # a line quoted in the text report; --json keeps it whole
READY: Final = (
    "ready to manage: the global batch, micro-batch, accumulation and checkpoint are known"
)
ASK_CHECKPOINT: Final = "unknown: pass --checkpoint-dir"
NOT_MANAGED: Final = "not managed"

ReadFile = Callable[[str], bytes]  # an absolute path -> its bytes; raises OwnerReadRefused
_OWNER_NAME = re.compile(r"\$(?:USER|LOGNAME)\b|\$\{(?:USER|LOGNAME)\}")
_OWNER_HOME = re.compile(r"\$HOME\b|\$\{HOME\}")


class FileState(StrEnum):
    READ = "read"
    MISSING = "missing"
    REFUSED = "refused"  # there, but not read: not a regular file, a link, no rights, too big
    SKIPPED = "skipped"  # not tried: over the file or round limit, or its path is not known


@dataclass(frozen=True)
class FileOutcome:
    """One file the script names, and what became of it."""

    path: str  # as the script names it
    location: str | None  # where it was looked for; None when the path could not be placed
    state: FileState
    refusal: RefusalKind | None
    reason: str


@dataclass(frozen=True)
class Gathered:
    """The last analysis of a script and the files read for it."""

    script: str
    submit_dir: str
    analysis: Analysis
    files: tuple[FileOutcome, ...]
    rounds: int
    texts: Mapping[str, str] = field(default_factory=dict)  # path the script names -> text read


class ScriptUnreadable(Exception):
    """The script itself could not be read or analysed: nothing to report on."""


def caller_reader(owner: Owner | None = None) -> ReadFile:
    """Reads with the caller's rights (or `owner`'s) through the bounded reader: one file in
    its own directory's tree, regular files only, at most one byte over the cap."""
    files = OwnerFiles.as_caller() if owner is None else OwnerFiles(owner)

    def read(location: str) -> bytes:
        return files.read_tail(location, MAX_FILE_BYTES + 1, tree=posixpath.dirname(location))

    return read


def read_text(read: ReadFile, location: str) -> str:
    """A file's text as the analysis takes it (bytes that are not UTF-8 kept as surrogates);
    a file over the cap or with NUL bytes is refused like one the reader would not open."""
    data = read(location)
    if len(data) > MAX_FILE_BYTES:
        raise _refused(RefusalKind.TOO_LARGE, location, f"over {MAX_FILE_BYTES} bytes")
    if b"\0" in data:
        raise _refused(RefusalKind.UNUSABLE, location, "NUL bytes: not a text file")
    return data.decode("utf-8", "surrogateescape")


def read_script(read: ReadFile, location: str) -> str:
    try:
        return read_text(read, location)
    except OwnerReadRefused as error:
        refusal = error.refusal
        raise ScriptUnreadable(
            f"cannot read {location}: {refusal.kind}: {refusal.reason}"
        ) from None


def gather(
    script: str,
    *,
    name: str,
    read: ReadFile,
    submit_dir: str,
    owner: Owner,
    knob_names: Mapping[str, Knob] | None = None,
) -> Gathered:
    """Analyse `script`, read what it asks for, again, until nothing new is wanted."""
    try:
        analysis = analyse(script, name=name, knob_names=knob_names)
    except ImporterError as error:
        raise ScriptUnreadable(str(error)) from error
    texts: dict[str, str] = {}
    outcomes: dict[str, FileOutcome] = {}
    rounds = 1
    while True:
        wanted = [path for path in analysis.files_wanted if path not in outcomes]
        if not wanted:
            break
        if rounds >= MAX_ROUNDS:
            for path in wanted:
                outcomes[path] = FileOutcome(
                    path,
                    locate(path, submit_dir, owner),
                    FileState.SKIPPED,
                    None,
                    f"not read: stopped after {rounds} rounds",
                )
            break
        fresh: dict[str, str] = {}
        for path in wanted:
            outcome, text = _fetch(path, read, submit_dir, owner, tried=len(outcomes))
            outcomes[path] = outcome
            if text is not None:
                fresh[path] = text
        if not fresh:
            break
        try:
            analysis = analyse(script, name=name, files={**texts, **fresh}, knob_names=knob_names)
        except ImporterError as error:
            for path in fresh:
                outcomes[path] = _unusable(outcomes[path], f"not analysed: {error}")
            break
        texts.update(fresh)
        rounds += 1
    return Gathered(name, submit_dir, analysis, tuple(outcomes.values()), rounds, texts)


def locate(path: str, submit_dir: str, owner: Owner) -> str | None:
    """Where a path the script names lies for its owner: `~`, `$USER` and `$HOME` are the
    owner's, a relative path is relative to the submit directory."""
    if path.startswith("~/") or _OWNER_HOME.search(path):
        home = _home(owner)
        if home is None:
            return None
        expanded = home + path[1:] if path.startswith("~/") else path
        path = _OWNER_HOME.sub(lambda _: home, expanded)
    path = _OWNER_NAME.sub(lambda _: owner.name, path)
    return posixpath.normpath(posixpath.join(submit_dir, path))


def _fetch(
    path: str, read: ReadFile, submit_dir: str, owner: Owner, *, tried: int
) -> tuple[FileOutcome, str | None]:
    """One file the analysis asks for; `tried` files were asked for before it."""
    location = locate(path, submit_dir, owner)
    if location is None:
        reason = f"not read: the home directory of {owner.name} is not known"
        return FileOutcome(path, None, FileState.SKIPPED, None, reason), None
    if tried >= MAX_FILES:
        reason = f"not read: the script names more than {MAX_FILES} files"
        return FileOutcome(path, location, FileState.SKIPPED, None, reason), None
    try:
        text = read_text(read, location)
    except OwnerReadRefused as error:
        refusal = error.refusal
        state = FileState.MISSING if refusal.kind is RefusalKind.MISSING else FileState.REFUSED
        return FileOutcome(path, location, state, refusal.kind, refusal.reason), None
    return FileOutcome(path, location, FileState.READ, None, "read"), text


def _unusable(outcome: FileOutcome, reason: str) -> FileOutcome:
    return FileOutcome(
        outcome.path, outcome.location, FileState.REFUSED, RefusalKind.UNUSABLE, reason
    )


def _home(owner: Owner) -> str | None:
    try:
        return pwd.getpwuid(owner.uid).pw_dir or None
    except KeyError:
        return None


def _refused(kind: RefusalKind, location: str, reason: str) -> OwnerReadRefused:
    return OwnerReadRefused(Refusal(kind, location, Owner.current().name, reason))


# ---------------------------------------------------------------- the document


def report_document(gathered: Gathered, checkpoint_dir: str | None = None) -> dict[str, Any]:
    """Everything the report says, as one JSON-ready document (keys in `DOCUMENT_KEYS`)."""
    analysis = gathered.analysis
    checkpoint = _checkpoint(analysis.reading(Knob.CHECKPOINT_DIR), checkpoint_dir)
    document = {
        "script": gathered.script,
        "submit_dir": gathered.submit_dir,
        "files": [_file_json(outcome) for outcome in gathered.files],
        "knobs": [_reading_json(reading) for reading in analysis.knobs],
        "checkpoint": checkpoint,
        "launches": [_launch_json(launch) for launch in analysis.launches],
        "insertions": _insertions(analysis),
        "notes": list(analysis.notes),
        "verdict": _verdict(analysis, checkpoint),
    }
    cleaned: dict[str, Any] = _without_surrogates(document)
    return cleaned


def import_document(
    gathered: Gathered, template: LaunchTemplate, checkpoint_dir: str | None = None
) -> dict[str, Any]:
    """The report after `template import`: the analysis's document, the template written,
    and a verdict about what that template manages."""
    document = report_document(gathered, checkpoint_dir)
    section = template_json(template)
    document["template"] = _without_surrogates(section)
    document["verdict"] = _managed_verdict(template, document["checkpoint"])
    return document


def template_json(template: LaunchTemplate) -> dict[str, Any]:
    """Each knob of an imported template: managed with its value and where a change goes, or
    "not managed: <why>" (never a placeholder shown as a value)."""
    imported = template.imported
    knobs = []
    for spec in template.dialect.knobs:
        reason = template.not_managed.get(spec.name)
        managed = imported.managed.get(spec.name) if imported is not None else None
        line = imported.line_of(spec.name) if imported is not None else None
        knobs.append(
            {
                "knob": spec.name,
                "managed": reason is None,
                "value": None if reason is not None else _knob_json(template.knobs[spec.name]),
                "where": managed.where if managed is not None else None,
                "line": _line_json(line),
                "through_copy": list(managed.through) if managed is not None else [],
                "not_managed": None if reason is None else f"{NOT_MANAGED}: {reason}",
            }
        )
    return {
        "name": template.name,
        "dialect": template.dialect.name,
        "directory": str(template.directory) if template.directory else None,
        "knobs": knobs,
        "configs": configs_json(template),
        "checkpoint": template.checkpoint.root if template.checkpoint else None,
    }


def configs_json(template: LaunchTemplate) -> list[dict[str, Any]]:
    """The config files an imported template keeps: the path the script names, the copy, the
    knobs managed through it, and why a change cannot go through it (null when it can)."""
    imported = template.imported
    if imported is None:
        return []
    return [
        {
            "path": path,
            "copy": carried.config.copy,
            "knobs": [m.knob for m in imported.managed.values() if path in m.through],
            "not_usable": carried.why_not or None,
        }
        for path, carried in imported.configs.items()
    ]


def _knob_json(value: KnobValue) -> Any:
    return knobs_to_json({"value": value})["value"]


def _managed_verdict(template: LaunchTemplate, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The verdict's four terms, each known only when the template manages it (or, for the
    global batch and the accumulation, when the managed others fix it)."""
    dialect, reasons = template.dialect, template.not_managed
    micro = dialect.roles[Role.MICRO_BATCH]
    accum, global_knob = dialect.knob_for(Role.GRAD_ACCUM), dialect.knob_for(Role.GLOBAL_BATCH)
    terms: dict[str, dict[str, str]] = {"micro_batch": _managed_term(micro, reasons)}
    if global_knob is not None:
        terms["global_batch"] = _managed_term(global_knob, reasons)
        if global_knob in reasons:
            terms["grad_accum"] = _term("missing", _UNDETERMINED_ACCUM)
        else:
            terms["grad_accum"] = _term("implied", _IMPLIED_ACCUM)
    elif accum is not None:
        terms["grad_accum"] = _managed_term(accum, reasons)
        known = invariant_known(dialect, reasons)
        terms["global_batch"] = (
            _term("implied", _IMPLIED_GLOBAL) if known else _term("missing", _UNDETERMINED_GLOBAL)
        )
    if template.checkpoint is None:
        terms["checkpoint_dir"] = _term("missing", ASK_CHECKPOINT)
    else:
        state = "given" if checkpoint["state"] == "given" else "managed"
        terms["checkpoint_dir"] = _term(state, template.checkpoint.root)
    ordered = {name: terms[name] for name in _TERM_WORDS if name in terms}
    return _verdict_of(ordered)


def _managed_term(knob: str, reasons: Mapping[str, str]) -> dict[str, str]:
    if knob in reasons:
        return _term("missing", f"{NOT_MANAGED} in this template ({knob}: {reasons[knob]})")
    return _term("managed", knob)


DOCUMENT_KEYS: Final = """\b
  script, submit_dir       the script as given; the directory relative paths are read from
  files[]                  path, location, state (read|missing|refused|skipped), refusal, reason
  knobs[]                  knob, status (found|runtime|invalid|not_found), value, reason,
                           occurrences[]: effect (wins|overridden|mirror), status, value, basis,
                           source, presence, reason, written[] and via[] lines
  checkpoint               state (found|given|unknown), directory, source, line, script_value,
                           reason
  launches[]               launcher, program, primary, het_group, line, resume_flags
  insertions               env: where an export would go; resume[]: where a resume flag would
                           go, per primary launch (available, file, after_line, why,
                           launch, launcher, program, existing_flags)
  notes[]                  what the analysis could not read or found odd
  verdict                  ready, text (the one-line verdict), missing[] (knob names),
                           terms: {global_batch, micro_batch, grad_accum, checkpoint_dir} ->
                           state (written|implied|given|missing; after import: managed
                           instead of written), why
  template                 (after import) name, dialect, directory, checkpoint, knobs[]:
                           knob, managed, value, where, line, through_copy[] (config
                           paths a change is written through), not_managed ("not managed:
                           why"); configs[]: path, copy, knobs[], not_usable (why, or null)
  a line is {file, number, text}; text that is not UTF-8 is written \\xNN"""


def _file_json(outcome: FileOutcome) -> dict[str, Any]:
    return {
        "path": outcome.path,
        "location": outcome.location,
        "state": outcome.state.value,
        "refusal": outcome.refusal.value if outcome.refusal else None,
        "reason": outcome.reason,
    }


def _reading_json(reading: KnobReading) -> dict[str, Any]:
    return {
        "knob": reading.knob.value,
        "status": reading.status.value,
        "value": reading.value,
        "reason": reading.reason,
        "occurrences": [_occurrence_json(occurrence) for occurrence in reading.occurrences],
    }


def _occurrence_json(occurrence: Occurrence) -> dict[str, Any]:
    written = [site.line for site in (occurrence.site, *occurrence.pieces) if site is not None]
    return {
        "effect": occurrence.effect.value,
        "status": occurrence.status.value,
        "value": occurrence.value,
        "basis": occurrence.basis.value,
        "source": occurrence.source,
        "presence": occurrence.presence,
        "reason": occurrence.reason,
        "written": [_line_json(line) for line in _unique(written)],
        "via": [_line_json(line) for line in _unique(occurrence.via) if line not in written],
    }


def _line_json(line: Line | None) -> dict[str, Any] | None:
    if line is None:
        return None
    return {"file": line.file, "number": line.number, "text": line.text}


def _site_line(site: Site | None) -> dict[str, Any] | None:
    return None if site is None else _line_json(site.line)


def _checkpoint(reading: KnobReading, given: str | None) -> dict[str, Any]:
    winner = reading.winner
    line = _site_line(winner.site) if winner else None
    if line is None and winner is not None and winner.via:
        line = _line_json(winner.via[0])
    script_value = reading.value if reading.status is Status.FOUND else None
    source = winner.source if winner else None
    if given is not None:
        reason = "given with --checkpoint-dir"
        if script_value is not None and script_value != given:
            reason += f"; the script writes its checkpoints to {script_value} ({source})"
        elif reading.status is not Status.FOUND:
            reason += f"; the script: {reading.reason}"
        return {
            "state": "given",
            "directory": given,
            "source": "--checkpoint-dir",
            "line": line if script_value is not None else None,
            "script_value": script_value,
            "reason": reason,
        }
    if script_value is not None:
        return {
            "state": "found",
            "directory": script_value,
            "source": source,
            "line": line,
            "script_value": script_value,
            "reason": reading.reason,
        }
    return {
        "state": "unknown",
        "directory": None,
        "source": source,
        "line": line,
        "script_value": None,
        "reason": reading.reason,
    }


def _launch_json(launch: Launch) -> dict[str, Any]:
    return {
        "launcher": launch.launcher,
        "program": launch.program,
        "primary": launch.primary,
        "het_group": launch.het_group,
        "line": _line_json(launch.line),
        "resume_flags": list(launch.resume_flags),
    }


def _insertion_json(insertion: Insertion) -> dict[str, Any]:
    return {
        "available": insertion.offset is not None,
        "file": insertion.file if insertion.offset is not None else None,
        "after_line": _line_json(insertion.line) if insertion.offset is not None else None,
        "why": insertion.why,
    }


def _insertions(analysis: Analysis) -> dict[str, Any]:
    resume = []
    for launch in analysis.launches:
        if not launch.primary:
            continue
        place = _insertion_json(launch.args_end)
        place["launch"] = _line_json(launch.line)
        place["launcher"] = launch.launcher
        place["program"] = launch.program
        place["existing_flags"] = list(launch.resume_flags)
        resume.append(place)
    return {"env": _insertion_json(analysis.env_insertion), "resume": resume}


def _verdict(analysis: Analysis, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The four terms a batch-size change needs, how each is known, and the one-line verdict."""
    micro = analysis.reading(Knob.MICRO_BATCH)
    accum = analysis.reading(Knob.GRAD_ACCUM)
    global_batch = analysis.reading(Knob.GLOBAL_BATCH)
    written = {r.knob for r in (micro, accum, global_batch) if r.status is Status.FOUND}
    terms: dict[str, dict[str, str]] = {}
    if Knob.GLOBAL_BATCH in written:
        terms["global_batch"] = _term("written", global_batch.reason)
    elif {Knob.MICRO_BATCH, Knob.GRAD_ACCUM} <= written and global_batch.status is Status.NOT_FOUND:
        terms["global_batch"] = _term("implied", _IMPLIED_GLOBAL)
    elif global_batch.status is Status.NOT_FOUND:
        terms["global_batch"] = _term("missing", _UNDETERMINED_GLOBAL)
    else:
        terms["global_batch"] = _term("missing", _why_missing(global_batch))
    terms["micro_batch"] = (
        _term("written", micro.reason)
        if Knob.MICRO_BATCH in written
        else _term("missing", _why_missing(micro))
    )
    if Knob.GRAD_ACCUM in written:
        terms["grad_accum"] = _term("written", accum.reason)
    elif Knob.GLOBAL_BATCH in written and accum.status is Status.NOT_FOUND:
        terms["grad_accum"] = _term("implied", _IMPLIED_ACCUM)
    else:
        terms["grad_accum"] = _term("missing", _why_missing(accum))
    if checkpoint["state"] == "unknown":
        terms["checkpoint_dir"] = _term("missing", ASK_CHECKPOINT)
    else:
        state = "given" if checkpoint["state"] == "given" else "written"
        terms["checkpoint_dir"] = _term(state, checkpoint["reason"])
    return _verdict_of(terms)


def _verdict_of(terms: dict[str, dict[str, str]]) -> dict[str, Any]:
    missing = [name for name, term in terms.items() if term["state"] == "missing"]
    if not missing:
        return {"ready": True, "text": READY, "missing": [], "terms": terms}
    by_why: dict[str, list[str]] = {}
    for name in missing:
        by_why.setdefault(terms[name]["why"], []).append(_TERM_WORDS[name])
    words = "; ".join(f"{_listed(names)} {why}" for why, names in by_why.items())
    return {
        "ready": False,
        "text": f"not ready to manage: {words}",
        "missing": missing,
        "terms": terms,
    }


_TERM_WORDS = {
    "global_batch": "global batch",
    "micro_batch": "micro-batch",
    "grad_accum": "accumulation",
    "checkpoint_dir": "checkpoint",
}
_IMPLIED_GLOBAL = (
    "micro-batch x accumulation x data-parallel ranks: kept when their product is kept"
)
_IMPLIED_ACCUM = "the framework derives it from the global batch and the micro-batch"
_UNDETERMINED_GLOBAL = "not written, nor implied by a known micro-batch and accumulation"
_UNDETERMINED_ACCUM = "the framework derives it from a global batch that is not managed"


def _term(state: str, why: str) -> dict[str, str]:
    return {"state": state, "why": why}


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _why_missing(reading: KnobReading) -> str:
    if reading.status is Status.NOT_FOUND:
        return f"not managed in this template ({reading.reason})"
    if reading.status is Status.RUNTIME:
        return f"set at run time ({reading.reason.removeprefix('set at run time: ')})"
    return f"not usable ({reading.reason})"


def _unique(lines: tuple[Line, ...] | list[Line]) -> list[Line]:
    return list(dict.fromkeys(lines))


def _without_surrogates(value: Any) -> Any:
    """Bytes of the user's files that are not UTF-8 (kept as surrogates for splicing) as
    `\\xNN` text: a document any JSON reader and any terminal takes."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {key: _without_surrogates(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_surrogates(item) for item in value]
    return value


# ---------------------------------------------------------------- the text report

_EFFECT_WORDS = {
    "wins": "wins",
    "overridden": "overridden",
    "mirror": "mirror (another reader's copy: must agree)",
}
_BASIS_WORDS = {
    Basis.ALLOCATION.value: "#SBATCH directive",
    Basis.FRAMEWORK.value: "documented flag or key",
    Basis.CONVENTION.value: "a common name: check that the program means it so",
    Basis.USER.value: "your --knob mapping",
    Basis.ENVIRONMENT.value: "environment variable the runtime reads",
}


def report_lines(document: Mapping[str, Any]) -> list[str]:
    """The document for a terminal; every text from the user's files passes `printable`."""
    out = [f"script: {_shown(document['script'])}"]
    out.append(f"relative paths read from: {_shown(document['submit_dir'])}")
    out.extend(_files_section(document["files"]))
    knobs = document["knobs"]
    sections = (
        ("Knobs", [k for k in knobs if k["status"] == Status.FOUND.value], _found_knob),
        ("Set at run time", [k for k in knobs if k["status"] == Status.RUNTIME.value], _runtime),
        (
            "Not managed in this template",
            [k for k in knobs if k["status"] in {Status.NOT_FOUND.value, Status.INVALID.value}],
            _not_managed,
        ),
    )
    for title, readings, show in sections:
        if readings:
            out.extend(["", title])
            for reading in readings:
                out.extend(show(reading))
    out.extend(["", "Checkpoint directory", *_checkpoint_lines(document["checkpoint"])])
    out.extend(["", "Where slurm-medic would add text", *_insertion_lines(document)])
    if "template" in document:
        out.extend(["", *_template_lines(document["template"])])
    if document["notes"]:
        out.extend(["", "Notes", *(f"  - {_shown(note)}" for note in document["notes"])])
    verdict = document["verdict"]
    out.extend(["", "What a batch change needs"])
    for name, term in verdict["terms"].items():
        out.append(f"  {_TERM_WORDS[name]}: {term['state']}: {_shown(term['why'])}")
    out.extend(["", f"verdict: {_shown(verdict['text'])}"])
    return out


def _template_lines(section: dict[str, Any]) -> list[str]:
    where = f" in {_shown(section['directory'])}" if section["directory"] else ""
    lines = [f"The template {_shown(section['name'])} ({section['dialect']}){where}"]
    width = max(len(knob["knob"]) for knob in section["knobs"])
    for knob in section["knobs"]:
        name = knob["knob"].ljust(width)
        if not knob["managed"]:
            lines.append(f"  {name}  {_shown(knob['not_managed'])}")
            continue
        value = json.dumps(knob["value"], ensure_ascii=False)
        lines.append(f"  {name}  {_shown(value)}: {_shown(knob['where'])}")
    lines.extend(config_lines(section["configs"]))
    checkpoint = section["checkpoint"]
    lines.append(f"  checkpoints: {_shown(checkpoint) if checkpoint else ASK_CHECKPOINT}")
    return lines


def config_lines(configs: list[dict[str, Any]]) -> list[str]:
    """The kept config copies for a terminal (the import report and `template show`)."""
    lines = []
    for config in configs:
        head = f"  config {_shown(config['path'])} kept as {_shown(config['copy'])}: "
        if config["not_usable"]:
            lines.append(head + f"a change cannot go through it: {_shown(config['not_usable'])}")
        elif config["knobs"]:
            knobs = ", ".join(config["knobs"])
            lines.append(head + f"{knobs} managed through the copy (the script writes it)")
        else:
            lines.append(head + "no managed knob is written in it")
    return lines


def _files_section(files: list[dict[str, Any]]) -> list[str]:
    if not files:
        return []
    lines = ["", "Files the script names"]
    for item in files:
        where = f" ({_shown(item['location'])})" if item["location"] else ""
        detail = "" if item["state"] == FileState.READ.value else f": {_shown(item['reason'])}"
        refused = item["state"] == FileState.REFUSED.value and item["refusal"]
        refusal = f" ({item['refusal']})" if refused else ""
        lines.append(f"  {_shown(item['path'])}{where}: {item['state']}{refusal}{detail}")
    return lines


def _found_knob(reading: dict[str, Any]) -> list[str]:
    lines = [f"  {reading['knob']} = {_shown(reading['value'])}"]
    return lines + _occurrence_lines(reading)


def _runtime(reading: dict[str, Any]) -> list[str]:
    lines = [f"  {reading['knob']}: set at run time: {_shown(reading['value'])}"]
    why = reading["reason"].removeprefix("set at run time: ")
    if not any(why == occurrence["source"] for occurrence in reading["occurrences"]):
        lines.append(f"      {_shown(why)}")
    return lines + _occurrence_lines(reading)


def _not_managed(reading: dict[str, Any]) -> list[str]:
    if reading["status"] == Status.INVALID.value:
        lines = [
            f"  {reading['knob']}: not managed in this template: written as "
            f"{_shown(reading['value'])}, which it cannot take ({_shown(reading['reason'])})"
        ]
        return lines + _occurrence_lines(reading)
    return [f"  {reading['knob']}: not managed in this template: {_shown(reading['reason'])}"]


def _occurrence_lines(reading: dict[str, Any]) -> list[str]:
    """Each place that sets the knob: which one wins, what names it, and its lines; a value
    is repeated only where it differs from the knob's."""
    lines = []
    for occurrence in reading["occurrences"]:
        effect = _EFFECT_WORDS[occurrence["effect"]]
        basis = _BASIS_WORDS[occurrence["basis"]]
        source, value = occurrence["source"], occurrence["value"]
        same = value is None or value == reading["value"] or value in source
        shown_value = "" if same else f" = {_shown(value)}"
        lines.append(f"    {effect}: {_shown(source)}{shown_value} ({basis})")
        if occurrence["reason"] not in {"", source}:
            lines.append(f"      {_shown(occurrence['reason'])}")
        lines.extend(_quoted("written", line) for line in occurrence["written"])
        lines.extend(_quoted("via", line) for line in occurrence["via"])
    return lines


def _checkpoint_lines(checkpoint: dict[str, Any]) -> list[str]:
    if checkpoint["state"] == "unknown":
        lines = [f"  {ASK_CHECKPOINT}", f"      the script: {_shown(checkpoint['reason'])}"]
    else:
        lines = [
            f"  {_shown(checkpoint['directory'])}",
            f"      {checkpoint['state']}: {_shown(checkpoint['reason'])}",
        ]
    if checkpoint["line"]:
        lines.append(_quoted("written", checkpoint["line"]))
    return lines


def _insertion_lines(document: Mapping[str, Any]) -> list[str]:
    insertions = document["insertions"]
    lines = ["  an environment export:", *_place(insertions["env"])]
    if not insertions["resume"]:
        lines.append("  a resume flag: nowhere: no command that starts training was found")
    for place in insertions["resume"]:
        launch = place["launch"]
        lines.append(
            f"  a resume flag for {_shown(place['launcher'])} {_shown(place['program'])}"
            f" (started at {_shown(launch['file'])}:{launch['number']}):"
        )
        lines.extend(_place(place))
        if place["existing_flags"]:
            flags = ", ".join(place["existing_flags"])
            lines.append(f"      the command already passes {_shown(flags)}")
    return lines


def _place(insertion: dict[str, Any]) -> list[str]:
    if not insertion["available"]:
        return [f"      nowhere: {_shown(insertion['why'])}"]
    lines = [f"      {_shown(insertion['why'])}"]
    if insertion["after_line"]:
        lines.append(_quoted("after", insertion["after_line"]))
    return lines


def _quoted(label: str, line: dict[str, Any]) -> str:
    text = line["text"]
    if len(text) > SHOWN_LINE_CHARS:
        text = text[:SHOWN_LINE_CHARS] + "..."
    return f"      {label} {_shown(line['file'])}:{line['number']}: {_shown(text)}"


def _shown(text: str | None) -> str:
    """User text on one line of a terminal: controls escaped, a newline shown as `\\n`."""
    if text is None:
        return "-"
    return printable(text).replace("\n", "\\n")
