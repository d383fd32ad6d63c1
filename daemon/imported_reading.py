"""Reading an imported template: the user's script analysed again, and which dialect knobs it
manages, where each is written, and why the others are not managed.

A dialect knob is *managed* only where the analysis found its value written in the script
itself, every copy that the run reads agreeing; anything else (set at run time, assembled
from pieces, living in another file, invalid, not written at all) is *not managed*, with the
reason, and is never rendered nor offered as a value. Three knobs the daemon needs are added
where the script lacks them, at the places the analysis found safe: exports after the #SBATCH
header, one `#SBATCH --exclude` line, and the dialect's resume flag at the end of the training
command's arguments. Apart from rendering (`imported_render`) because this side only reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from daemon.dialects.base import Dialect, KnobError, KnobKind, KnobValue, Role
from daemon.imported import (
    COPY_DELIMITER,
    ROLE_OF,
    CarriedConfig,
    ConfigCopy,
    ImportedScript,
    Managed,
    SpliceError,
    Writing,
)
from daemon.importer import (
    Analysis,
    Effect,
    Form,
    ImporterError,
    Insertion,
    Knob,
    Launch,
    Site,
    Status,
    analyse,
)
from daemon.importer.records import ConfigUse
from daemon.importer.vocabulary import ALLOC_CONF_VARIABLES
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist

_NO_COUNTERPART = "slurm-medic does not read it in an imported script"
# Where the path to a copy can be written: `$HOME` must expand there, once, in this shell.
_PATH_FORMS = frozenset({Form.SHELL_WORD, Form.DOUBLE_QUOTED})


def read_imported(
    dialect: Dialect,
    text: str,
    *,
    file: str,
    knob_names: Mapping[str, Knob],
    elsewhere: Mapping[Knob, str],
    checkpoint_dir: str | None,
    configs: Sequence[ConfigCopy] = (),
) -> ImportedScript:
    """Analyse the script (with the config copies the template keeps, under the paths the
    script names) and decide, knob by knob, what is managed and how."""
    files = {config.path: config.text for config in configs}
    try:
        analysis = analyse(text, name=file, files=files, knob_names=knob_names)
    except ImporterError as error:
        raise SpliceError(f"the script cannot be analysed: {error}") from error
    carried = {config.path: _carried(config, analysis, text=text, file=file) for config in configs}
    managed: dict[str, Managed] = {}
    not_managed: dict[str, str] = {}
    values: dict[str, KnobValue] = {}
    counterpart = {dialect.roles.get(role): knob for knob, role in ROLE_OF.items()}
    for spec in dialect.knobs:
        source = counterpart.get(spec.name)
        if source is not None:
            outcome = _site_knob(
                dialect,
                analysis=analysis,
                knob=spec.name,
                source=source,
                file=file,
                elsewhere=elsewhere,
                carried=carried,
            )
            if isinstance(outcome, str):
                not_managed[spec.name] = outcome
            else:
                managed[spec.name], values[spec.name] = outcome
        elif spec.name not in _insertion_knobs(dialect):
            not_managed[spec.name] = _NO_COUNTERPART
    _unshare(analysis, managed, not_managed, values)
    found = (managed, not_managed, values)
    env_sites = _env(dialect, analysis, file=file, elsewhere=elsewhere, found=found)
    _exclude(dialect, analysis, found)
    _resume(dialect, analysis, file=file, found=found)
    for spec in dialect.knobs:
        if spec.name not in values:
            values[spec.name] = (
                spec.unset if spec.unset is not None else dialect.defaults[spec.name]
            )
    return ImportedScript(
        text=text,
        file=file,
        analysis=analysis,
        knob_names=dict(knob_names),
        managed=managed,
        not_managed=not_managed,
        values=values,
        env_sites=env_sites,
        checkpoint_dir=checkpoint_dir,
        configs=carried,
    )


# What is being decided about the knobs: managed ones, the others with why, and values.
_Found = tuple[dict[str, Managed], dict[str, str], dict[str, KnobValue]]


def _insertion_knobs(dialect: Dialect) -> frozenset[str]:
    roles = (Role.ENV, Role.EXCLUDE, Role.RESUME, Role.RESUME_TAG)
    return frozenset(knob for role in roles if (knob := dialect.knob_for(role)) is not None)


def _site_knob(
    dialect: Dialect,
    *,
    analysis: Analysis,
    knob: str,
    source: Knob,
    file: str,
    elsewhere: Mapping[Knob, str],
    carried: Mapping[str, CarriedConfig],
) -> tuple[Managed, KnobValue] | str:
    """The knob managed at the places the analysis found it, or why it is not managed."""
    if source in elsewhere:
        return elsewhere[source]
    reading = analysis.reading(source)
    if reading.status is Status.NOT_FOUND:
        return f"{reading.reason}: slurm-medic will not invent a value"
    if reading.status is Status.RUNTIME:
        return reading.reason
    if reading.status is Status.INVALID:
        return f"written as {reading.value!r}, which it cannot take ({reading.reason})"
    if reading.unlisted:
        return (
            f"written in {len(reading.occurrences) + reading.unlisted} places, more than the "
            "analysis lists: a change could not be written at every one"
        )
    sites: list[Site] = []
    through: list[str] = []
    presence = False
    for occurrence in reading.occurrences:
        if occurrence.effect is Effect.OVERRIDDEN:
            continue
        where = occurrence.source
        if occurrence.status is Status.RUNTIME:
            return f"its copy in {where} is set at run time ({occurrence.reason})"
        if occurrence.status is not Status.FOUND:
            return f"its copy in {where} is {occurrence.value!r} ({occurrence.reason})"
        if occurrence.value != reading.value:
            return f"{where} gives {occurrence.value} but the run reads {reading.value}"
        if occurrence.site is None:
            return f"the value from {where} is assembled from pieces, not written in one place"
        if occurrence.site.file != file:
            config = carried.get(occurrence.site.file)
            if config is None:
                return f"the value from {where} lives in {occurrence.site.file}, not in the script"
            if config.why_not:
                return f"the value from {where} lives in {config.config.path}: {config.why_not}"
            through.append(config.config.path)
        presence = presence or occurrence.presence
        sites.append(occurrence.site)
    value = _typed(dialect, knob, reading.value or "")
    if isinstance(value, str) and value.startswith("\0"):
        return value[1:]
    where = ", ".join(f"{site.file}:{site.line.number}" for site in dict.fromkeys(sites))
    copies = tuple(dict.fromkeys(through))
    if copies:
        kept = ", ".join(carried[path].config.copy for path in copies)
        where += f" (through the template's copy, {kept}, which the script writes when changed)"
    managed = Managed(
        knob,
        Writing.SITES,
        f"written at {where}",
        source=source,
        sites=tuple(dict.fromkeys(sites)),
        presence=presence,
        through=copies,
    )
    return managed, value


def _carried(config: ConfigCopy, analysis: Analysis, *, text: str, file: str) -> CarriedConfig:
    """Whether a patched copy of `config` can stand for it: every place the script names it
    rewritten to the copy's path, the copy written by a quoted heredoc."""
    uses = [use for use in analysis.config_uses if use.file == config.path]
    sites: list[Site] = []
    why = "" if uses else "the script does not name it where a command reads it"
    for use in uses:
        why = why or _path_problem(use, file)
        if use.site is not None:
            sites.append(use.site)
    if not why and COPY_DELIMITER in config.text:
        why = f"its text holds {COPY_DELIMITER}, which would end the heredoc that writes the copy"
    if not why and "\r\n" in text:
        why = "the script's lines end in CRLF: bash would not find the end of the copy's heredoc"
    return CarriedConfig(config, tuple(dict.fromkeys(sites)), why)


def _path_problem(use: ConfigUse, file: str) -> str:
    """Why the place that names a config cannot name its copy instead; empty when it can."""
    site = use.site
    if site is None:
        return f"its path ({use.source}) is assembled from pieces, not written in one place"
    if site.file != file:
        return f"its path ({use.source}) is written in {site.file}, not in the script"
    if site.form not in _PATH_FORMS:
        return (
            f"its path ({use.source}) is written as {site.form.value} text, where the copy's "
            "path cannot be written safely"
        )
    return ""


def _unshare(
    analysis: Analysis,
    managed: dict[str, Managed],
    not_managed: dict[str, str],
    values: dict[str, KnobValue],
) -> None:
    """A knob written at a place another knob also reads (`--bs $BS --eval_bs $BS`) is not
    managed: a change of one would silently move the other."""
    for name, knob in list(managed.items()):
        for reading in analysis.knobs:
            if reading.knob is knob.source:
                continue
            places = [
                place
                for occurrence in reading.occurrences
                for place in (occurrence.site, *occurrence.pieces)
                if place is not None
            ]
            if any(_overlap(site, place) for site in knob.sites for place in places):
                del managed[name], values[name]
                not_managed[name] = (
                    f"written at the same place as {reading.knob.value}: a change would move both"
                )
                break


def _overlap(first: Site, second: Site) -> bool:
    return first.file == second.file and first.start < second.end and second.start < first.end


def _typed(dialect: Dialect, knob: str, text: str) -> KnobValue:
    """The analysis's value as the knob's type; a reason (marked by a NUL) when it does not fit."""
    spec = dialect.spec(knob)
    value: object = text
    if spec.kind is KnobKind.INT:
        value = int(text) if text.isascii() and text.isdigit() and len(text) < 4300 else text
    elif spec.kind is KnobKind.BOOL:
        value = {"true": True, "false": False}.get(text, text)
    try:
        return spec.validate(value)
    except KnobError as error:
        return f"\0written as {text!r}, which {knob} cannot take ({error})"


def _env(
    dialect: Dialect,
    analysis: Analysis,
    *,
    file: str,
    elsewhere: Mapping[Knob, str],
    found: _Found,
) -> dict[str, Site]:
    """The allocator variables the script exports, each at its place; others are added."""
    managed, not_managed, values = found
    knob = dialect.knob_for(Role.ENV)
    if knob is None:
        return {}
    insertion = analysis.env_insertion
    reading = analysis.reading(Knob.ALLOC_CONF)
    sites: dict[str, Site] = {}
    pairs: dict[str, str] = {}
    why = elsewhere.get(Knob.ALLOC_CONF, "")
    for occurrence in reading.occurrences:
        if why:
            break
        variable = occurrence.source
        if variable not in ALLOC_CONF_VARIABLES:
            why = f"the allocator setting comes from {variable}"
        elif occurrence.status is not Status.FOUND:
            why = f"{variable} is {reading.reason}"
        elif occurrence.site is None or occurrence.site.file != file:
            why = f"{variable} is not written in one place of the script"
        else:
            sites[variable] = occurrence.site
            pairs[variable] = occurrence.value
    if not why and insertion.offset is None:
        why = f"no place to add an export: {insertion.why}"
    if why:
        not_managed[knob] = why
        return {}
    where = "allocator variables replaced where the script sets them; other exports added "
    managed[knob] = Managed(knob, Writing.ENV, where + _after(insertion))
    values[knob] = tuple(sorted(pairs.items()))
    return sites


def _exclude(dialect: Dialect, analysis: Analysis, found: _Found) -> None:
    managed, not_managed, values = found
    knob = dialect.knob_for(Role.EXCLUDE)
    if knob is None:
        return
    directives = [d for d in analysis.directives if d.option == "exclude" and d.group == 0]
    if len(directives) > 1:
        not_managed[knob] = "the script has several --exclude directives"
        return
    if directives:
        directive = directives[0]
        if directive.site is None:
            not_managed[knob] = "the --exclude directive has no value"
            return
        try:
            nodes = dialect.spec(knob).validate(list(expand_hostlist(directive.value)))
        except (SlurmParseError, KnobError) as error:
            not_managed[knob] = f"--exclude={directive.value} is not a node list: {error}"
            return
        where = f"the --exclude directive at {directive.site.file}:{directive.site.line.number}"
        managed[knob] = Managed(knob, Writing.EXCLUDE, where, sites=(directive.site,))
        values[knob] = nodes
        return
    insertion = analysis.env_insertion
    if insertion.offset is None:
        not_managed[knob] = f"no place to add an #SBATCH --exclude line: {insertion.why}"
        return
    managed[knob] = Managed(knob, Writing.EXCLUDE, "an #SBATCH --exclude line " + _after(insertion))
    values[knob] = ()


def _resume(dialect: Dialect, analysis: Analysis, *, file: str, found: _Found) -> None:
    """The dialect's resume flag (and tag) at the end of the training command's arguments, or
    its resume variable exported after the header."""
    managed, not_managed, values = found
    for role in (Role.RESUME, Role.RESUME_TAG):
        knob = dialect.knob_for(role)
        if knob is None:
            continue
        flag = next((f for f, k in dialect.recognise_flags.items() if k == knob), None)
        variable = next((v for v, k in dialect.recognise_env.items() if k == knob), None)
        values[knob] = ""
        if flag is not None:
            place = resume_place(analysis, file)
            if isinstance(place, str):
                not_managed[knob] = place
                continue
            where = f"{flag} appended to the arguments of {place.program} " + _after(place.args_end)
            if flag in place.resume_flags:
                where += f" (after the {flag} already there: the last one given wins)"
            managed[knob] = Managed(knob, Writing.RESUME_FLAG, where, flag=flag)
        elif variable is not None:
            insertion = analysis.env_insertion
            if insertion.offset is None:
                not_managed[knob] = f"no place to add an export: {insertion.why}"
                continue
            where = f"export {variable} " + _after(insertion)
            managed[knob] = Managed(knob, Writing.RESUME_ENV, where, flag=variable)
        else:
            not_managed[knob] = _NO_COUNTERPART


def resume_place(analysis: Analysis, file: str) -> Launch | str:
    primary = [launch for launch in analysis.launches if launch.primary]
    if not primary:
        return "no command that starts training was found"
    if len(primary) > 1:
        return "several commands start training: which one resumes is not clear"
    launch = primary[0]
    if launch.launcher == "wrapper":
        return f"training starts in {launch.program}, which is not part of the template"
    if launch.args_end.offset is None:
        return f"no place to add a flag: {launch.args_end.why}"
    if launch.args_end.file != file:
        return f"the training command's arguments end in {launch.args_end.file}"
    return launch


def _after(insertion: Insertion) -> str:
    if insertion.line is None:
        return f"({insertion.why})"
    return f"{insertion.why} ({insertion.line.file}:{insertion.line.number})"
