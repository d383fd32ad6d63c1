"""The JSON document of `slurm-medic template analyse` and `template import`: what the importer
read in a script, and the verdict on it.

`report_document` turns a `Gathered` into one JSON-ready document that `--json` prints and the
text report (`import_report`) reads, so the two never say different things. After `template
import`, `import_document` adds the template that was written: each of its dialect's knobs,
managed (its value and where a change is written) or not managed and why, and the verdict is
then about what the template manages.

The verdict names the four things a batch-size remediation needs: the micro-batch and the
accumulation it trades against each other, the global batch it must keep, and the checkpoint
directory it resumes from. A term is known when the script writes it, or when the others imply
it (a written global batch fixes the accumulation in the frameworks that take one; a written
micro-batch and accumulation fix the global batch for a given world size); never from a
default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from daemon.commands.import_gather import FileOutcome, Gathered
from daemon.dialects.base import KnobValue, Role
from daemon.importer import (
    Analysis,
    Insertion,
    Knob,
    KnobReading,
    Launch,
    Line,
    Occurrence,
    Site,
    Status,
)
from daemon.templates.model import LaunchTemplate, invariant_known
from daemon.templates.revisions import knobs_to_json

READY: Final = (
    "ready to manage: the global batch, micro-batch, accumulation and checkpoint are known"
)
ASK_CHECKPOINT: Final = "unknown: pass --checkpoint-dir"
NOT_MANAGED: Final = "not managed"


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
    ordered = {name: terms[name] for name in TERM_WORDS if name in terms}
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
        by_why.setdefault(terms[name]["why"], []).append(TERM_WORDS[name])
    words = "; ".join(f"{_listed(names)} {why}" for why, names in by_why.items())
    return {
        "ready": False,
        "text": f"not ready to manage: {words}",
        "missing": missing,
        "terms": terms,
    }


TERM_WORDS = {
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
