"""The text report of `slurm-medic template analyse` and `template import`: the JSON document
(`import_json`) as a person reads it at a terminal.

It prints only what the document holds, so `--json` and the text never say different things;
every text from the user's files passes `printable`, and a quoted line is cut at
`SHOWN_LINE_CHARS` (the document keeps it whole). The files are gathered by `import_gather`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from daemon.commands.import_gather import FileState
from daemon.commands.import_json import ASK_CHECKPOINT, TERM_WORDS
from daemon.commands.terminal import printable
from daemon.importer import Basis, Status

SHOWN_LINE_CHARS: Final = 160  # a line quoted in the text report; --json keeps it whole

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
        out.append(f"  {TERM_WORDS[name]}: {term['state']}: {_shown(term['why'])}")
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
