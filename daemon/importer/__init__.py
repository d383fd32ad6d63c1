"""Reading real sbatch scripts: where each knob's value lives, and how to change it in place.

The analysis only reads: `analyse(script, files=...)` returns every knob's value with the span
of text that sets it, the launch commands and the safe places to add text. Nothing here does
I/O; the caller reads the files the analysis names and calls again.
"""

from daemon.importer.analysis import analyse, parse_knob_mapping
from daemon.importer.records import (
    Analysis,
    Basis,
    Directive,
    Effect,
    Form,
    ImporterError,
    Insertion,
    Knob,
    KnobReading,
    Launch,
    Line,
    Occurrence,
    Site,
    Status,
)

__all__ = [
    "Analysis",
    "Basis",
    "Directive",
    "Effect",
    "Form",
    "ImporterError",
    "Insertion",
    "Knob",
    "KnobReading",
    "Launch",
    "Line",
    "Occurrence",
    "Site",
    "Status",
    "analyse",
    "parse_knob_mapping",
]
