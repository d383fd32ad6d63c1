"""Which place wins when several set one knob, and what each of the others does.

The walk (`analysis`) collects every place a knob is given as a `Found`, ranked by how far that
kind of place is believed (an #SBATCH directive over the program's own flags over its config
over a launcher's copy), and every place a knob may hide in that it cannot see as a `Carrier`.
This reads one knob from them: the winning value and its site, each other occurrence as
overridden or a mirror that must agree, or the reason the value is only known at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from daemon.importer.configs import ConfigFormat
from daemon.importer.places import Places
from daemon.importer.records import (
    CONFIG_FORMS,
    MAX_OCCURRENCES,
    Basis,
    Effect,
    Form,
    Knob,
    KnobReading,
    Line,
    Occurrence,
    Site,
    Status,
)
from daemon.importer.values import (
    MAX_NUMBER_DIGITS,
    WHOLE_NUMBER,
    Text,
    whole_number,
    written_length,
)
from daemon.importer.vocabulary import Name

INT_KNOBS = frozenset(
    {
        Knob.MICRO_BATCH,
        Knob.GRAD_ACCUM,
        Knob.GLOBAL_BATCH,
        Knob.NODES,
        Knob.GPUS_PER_NODE,
        Knob.ZERO_STAGE,
        Knob.EVAL_BATCH,
        Knob.WORKERS,
        Knob.SEQ_LEN,
    }
)
TRAINING_KNOBS = frozenset(
    {
        Knob.MICRO_BATCH,
        Knob.GRAD_ACCUM,
        Knob.GLOBAL_BATCH,
        Knob.CHECKPOINT_DIR,
        Knob.ZERO_STAGE,
        Knob.RECOMPUTE,
        Knob.EVAL_BATCH,
        Knob.WORKERS,
        Knob.SEQ_LEN,
    }
)
_DEEPSPEED_KNOBS = frozenset(
    {Knob.MICRO_BATCH, Knob.GRAD_ACCUM, Knob.GLOBAL_BATCH, Knob.ZERO_STAGE}
)
_ACCELERATE_KNOBS = frozenset({Knob.ZERO_STAGE, Knob.RECOMPUTE})
# How far each kind of place is believed when several set one knob (higher wins).
RANK_DIRECTIVE = 5
RANK_ARGUMENT = 4  # the program's own flags and overrides: they win over its config file
RANK_CONFIG = 3
RANK_ENVIRONMENT = 3
RANK_LAUNCHER = 2
RANK_TOPOLOGY = 1
# Carriers: a place a knob may be set that the analysis cannot see, most specific first.
_CARRIER_ORDER = ("deepspeed", "accelerate", "training", "wrapper", "arguments", "program")
CARRIER_KNOBS = {
    "deepspeed": _DEEPSPEED_KNOBS,
    "accelerate": _ACCELERATE_KNOBS,
    "training": TRAINING_KNOBS,
    "wrapper": TRAINING_KNOBS | {Knob.ALLOC_CONF},
    "arguments": TRAINING_KNOBS,
    "program": TRAINING_KNOBS,
}
_BOOLEAN = {
    "true": "true",
    "false": "false",
    "1": "true",
    "0": "false",
    "yes": "true",
    "no": "false",
    "on": "true",
    "off": "false",
}


@dataclass
class Found:
    """One place a knob is given, before effects are decided."""

    knob: Knob
    value: Text | None  # None: the flag's presence
    name: Name
    source: str
    rank: int
    key: str  # what overrides what: the same key given again later replaces it
    use: Text | None = None  # where the flag or key is written (for the lines it went through)
    config_form: ConfigFormat | None = None
    order: int = 0


@dataclass(frozen=True)
class Carrier:
    kind: str  # one of _CARRIER_ORDER
    what: str  # in words
    expression: str
    place: Text | None


def read_knob(
    knob: Knob, found: list[Found], carriers: list[Carrier], places: Places
) -> KnobReading:
    """What the script says of `knob`: the place that wins among those `found`, the others
    with their effect; else the most specific place it may hide in (`carriers`); else nothing."""
    candidates = [f for f in found if f.knob is knob]
    occurrences, unlisted = _occurrences(knob, candidates, places)
    if occurrences:
        winner = occurrences[0]
        if winner.status is Status.FOUND:
            reason = f"{winner.value} from {winner.source}"
        elif winner.status is Status.RUNTIME:
            reason = f"set at run time: {winner.reason}"
        else:
            reason = f"{winner.source}: {winner.reason}"
        value = winner.value
        if unlisted:
            reason += f" (and {unlisted} more places, not listed)"
        return KnobReading(knob, winner.status, value, occurrences, reason, unlisted)
    carrier = _best_carrier(knob, carriers)
    if carrier is not None:
        occurrence = _carrier_occurrence(knob, carrier, places)
        return KnobReading(
            knob,
            Status.RUNTIME,
            carrier.expression,
            (occurrence,),
            f"set at run time: {carrier.what}",
        )
    return KnobReading(knob, Status.NOT_FOUND, None, (), "not set by the script")


def _occurrences(
    knob: Knob, candidates: list[Found], places: Places
) -> tuple[tuple[Occurrence, ...], int]:
    """The occurrences, winner first, and how many places past `MAX_OCCURRENCES` were left
    unread (each occurrence costs its sites and lines; thousands of one flag are no script's)."""
    if not candidates:
        return (), 0
    ordered = sorted(candidates, key=lambda f: (f.rank, -f.name.rank, f.order), reverse=True)
    winner = ordered[0]
    result: list[Occurrence] = []
    seen: set[tuple[str, int, int]] = set()
    for index, found in enumerate(ordered):
        if len(result) >= MAX_OCCURRENCES:
            return tuple(result), len(ordered) - index
        effect = Effect.WINS if found is winner else _effect(found, winner)
        occurrence = _occurrence(knob, found, effect, places)
        if occurrence is None:
            continue
        place = occurrence.site
        if place is not None:
            span = (place.file, place.start, place.end)
            if span in seen:
                continue
            seen.add(span)
        if not result and effect is not Effect.WINS:
            occurrence = _with_effect(occurrence, Effect.WINS)
        result.append(occurrence)
    return tuple(result), 0


def _effect(found: Found, winner: Found) -> Effect:
    if found.key == winner.key and found.rank == winner.rank:
        return Effect.OVERRIDDEN
    if winner.rank == RANK_ARGUMENT and found.key.startswith("config"):
        return Effect.OVERRIDDEN
    return Effect.MIRROR


def _occurrence(knob: Knob, found: Found, effect: Effect, places: Places) -> Occurrence | None:
    via = places.lines_through(found.use, found.value)
    if found.value is None:
        site = places.text_site(found.use) if found.use is not None else None
        return Occurrence(
            knob,
            "true",
            Status.FOUND,
            effect,
            found.name.basis,
            found.source,
            site,
            via=via,
            presence=True,
        )
    text = found.value.strip()
    text = _unquote(text)
    if text.opaque:
        unknowns = text.unknowns()
        reason = "; ".join(dict.fromkeys(f"{seg.text}: {seg.why}" for seg in unknowns))
        place = unknowns[0]
        site = None
        if place.file is not None and places.holds(place.file):
            site = places.site(
                place.file,
                place.start,
                place.start + written_length(place),
                place.form or Form.SHELL_WORD,
            )
        return Occurrence(
            knob,
            text.plain,
            Status.RUNTIME,
            effect,
            found.name.basis,
            found.source,
            site,
            via=via,
            reason=reason,
        )
    value, problem = _normalise_value(knob, text.plain)
    status = Status.INVALID if problem else Status.FOUND
    if status is Status.FOUND and not plausible(knob, value):
        return None
    site, pieces = places.value_sites(text, found.config_form)
    return Occurrence(
        knob,
        value,
        status,
        effect,
        found.name.basis,
        found.source,
        site,
        pieces,
        via,
        reason=problem,
    )


def _carrier_occurrence(knob: Knob, carrier: Carrier, places: Places) -> Occurrence:
    site: Site | None = None
    pieces: tuple[Site, ...] = ()
    lines: list[Line] = []
    if carrier.place is not None:
        site = places.text_site(carrier.place)
        if site is None:
            _, pieces = places.value_sites(carrier.place, None)
        for seg in carrier.place.segs:
            lines.extend(places.line(f.file, f.start) for f in seg.frames if places.holds(f.file))
    return Occurrence(
        knob,
        carrier.expression,
        Status.RUNTIME,
        Effect.WINS,
        Basis.FRAMEWORK,
        carrier.what,
        site,
        pieces,
        tuple(dict.fromkeys(lines)),
        reason=carrier.what,
    )


def disagreements(readings: tuple[KnobReading, ...]) -> list[str]:
    """Notes on copies of a winning value that say otherwise (a launcher's, a second config's)."""
    notes = []
    for reading in readings:
        if reading.status is not Status.FOUND:
            continue
        for occurrence in reading.occurrences[1:]:
            if (
                occurrence.effect is Effect.MIRROR
                and occurrence.status is Status.FOUND
                and occurrence.value != reading.value
            ):
                notes.append(
                    f"{reading.knob.value}: {reading.value} from {reading.winner.source}"  # type: ignore[union-attr]
                    f" but {occurrence.value} from {occurrence.source}"
                )
    return notes


def _unquote(text: Text) -> Text:
    plain = text.plain
    if len(plain) >= 2 and plain[0] == plain[-1] and plain[0] in "'\"" and not text.opaque:
        runs = text.runs()
        if runs is not None and len(runs) == 1 and (runs[0].form in CONFIG_FORMS):
            return text  # a config's own quoted scalar: the site keeps its quotes
        return text.slice(1, len(plain) - 1)
    return text


def _normalise_value(knob: Knob, raw: str) -> tuple[str, str]:
    """The value as the labels and remediators read it, and what is wrong with it if anything."""
    value = raw.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    if knob in INT_KNOBS:
        number = whole_number(value)
        if number is not None:
            return str(number), ""
        if WHOLE_NUMBER.match(value) and len(value) > MAX_NUMBER_DIGITS:
            return value, f"a number of {len(value)} digits"
        return value, f"{value!r} is not a whole number"
    if knob is Knob.RECOMPUTE:
        return _BOOLEAN.get(value.lower(), value), ""
    return value, ""


def plausible(knob: Knob, value: str) -> bool:
    """`save: true`, `save: 1000`: a switch or an interval, not a checkpoint directory."""
    if knob is not Knob.CHECKPOINT_DIR:
        return True
    plain = value.strip().strip("'\"").lower()
    return plain not in _BOOLEAN and not WHOLE_NUMBER.match(plain)


def _best_carrier(knob: Knob, carriers: list[Carrier]) -> Carrier | None:
    hiding = [c for c in carriers if knob in CARRIER_KNOBS[c.kind]]
    if not hiding:
        return None
    return min(hiding, key=lambda c: _CARRIER_ORDER.index(c.kind))


def without_fallbacks(found: list[Found]) -> list[Found]:
    """A fallback name (Lightning's default_root_dir beside a ModelCheckpoint's dirpath) names
    another place when a firmer name of its knob is set: it is no copy that must agree."""
    firm = {f.knob for f in found if not f.name.fallback}
    return [f for f in found if not (f.name.fallback and f.knob in firm)]


def _with_effect(occurrence: Occurrence, effect: Effect) -> Occurrence:
    return replace(occurrence, effect=effect)


class FoundMaker:
    """Numbers the places found in the order the walk meets them: of two places of one rank
    and key, the later overrides the earlier."""

    def __init__(self) -> None:
        self._count = 0

    def make(
        self,
        name: Name,
        value: Text | None,
        *,
        source: str,
        rank: int,
        key: str,
        use: Text | None = None,
        config_form: ConfigFormat | None = None,
    ) -> Found:
        self._count += 1
        return Found(name.knob, value, name, source, rank, key, use, config_form, self._count)
