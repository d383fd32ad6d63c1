"""What the analysis of an sbatch script says: each knob's value and the place it is written.

The contract between the analysis and whoever turns it into a template: every record is
frozen, every place is a span of the original text (so a value can be replaced where the user
wrote it and nothing else moves), and a knob the analysis could not pin down says why instead
of carrying a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_INPUT_CHARS = 1_048_576  # one script or config file; a real one is a few KB
MAX_OCCURRENCES = 32  # places one knob's reading lists; a real script writes a knob in a few


class ImporterError(ValueError):
    """The one error the importer raises: input it refuses to read (too big, binary, too deep)."""


class Knob(StrEnum):
    """The settings slurm-medic can manage, by the names the labels and remediators use."""

    MICRO_BATCH = "micro_batch"
    GRAD_ACCUM = "grad_accum"
    GLOBAL_BATCH = "global_batch"
    NODES = "nodes"
    GPUS_PER_NODE = "gpus_per_node"
    CHECKPOINT_DIR = "checkpoint_dir"
    ZERO_STAGE = "zero_stage"
    RECOMPUTE = "recompute"
    EVAL_BATCH = "eval_batch"
    WORKERS = "workers"
    SEQ_LEN = "seq_len"
    ALLOC_CONF = "alloc_conf"


class Status(StrEnum):
    """How much the script tells about a knob."""

    FOUND = "found"  # a literal value written in the script or a file given with it
    RUNTIME = (
        "runtime"  # set at run time: `$1`, the environment, a command's output, a file not given
    )
    INVALID = "invalid"  # written, but not a value the knob can take (a placeholder, `auto`...)
    NOT_FOUND = "not_found"  # nothing in view sets it: the knob is not managed


class Effect(StrEnum):
    """What one occurrence of a knob does when several places set it."""

    WINS = "wins"  # the value the run uses
    OVERRIDDEN = "overridden"  # written, but a later flag or override replaces it
    MIRROR = "mirror"  # another reader's copy (a launcher, a second config) that must agree


class Basis(StrEnum):
    """Why the analysis reads a name as a knob: how far to trust the reading."""

    ALLOCATION = "allocation"  # an #SBATCH directive
    FRAMEWORK = "framework"  # a documented flag or key of the launcher or framework
    CONVENTION = (
        "convention"  # a common name (`--batch_size`) a script's own parser may mean otherwise
    )
    USER = "user"  # a mapping the user gave (`--knob micro_batch=--batch_size`)
    ENVIRONMENT = "environment"  # an exported variable the runtime reads (PYTORCH_CUDA_ALLOC_CONF)


class Form(StrEnum):
    """How the text at a place is read, hence how a new value must be written there."""

    SHELL_WORD = "shell_word"  # unquoted shell text: a bare word
    DOUBLE_QUOTED = "double_quoted"  # inside "...": `$`, backquote, `"` and `\\` are live
    SINGLE_QUOTED = "single_quoted"  # inside '...': anything but `'`
    ANSI_C = "ansi_c"  # inside $'...'
    HEREDOC = "heredoc"  # an unquoted here-document body: `$`, backquote and `\\` are live
    HEREDOC_LITERAL = "heredoc_literal"  # a quoted here-document body: taken as written
    DIRECTIVE = "directive"  # an #SBATCH option's value
    JSON = "json"  # a JSON scalar (quotes included when it is a string)
    YAML = "yaml"  # a YAML scalar (quotes included when it is quoted)
    TOML = "toml"  # a TOML value (quotes included when it is a string)
    PYTHON = "python"  # a Python literal in a config of plain assignments


SHELL_FORMS = frozenset(
    {
        Form.SHELL_WORD,
        Form.DOUBLE_QUOTED,
        Form.SINGLE_QUOTED,
        Form.ANSI_C,
        Form.HEREDOC,
        Form.HEREDOC_LITERAL,
    }
)
CONFIG_FORMS = frozenset({Form.JSON, Form.YAML, Form.TOML, Form.PYTHON})


@dataclass(frozen=True)
class Line:
    """One physical line of a file, for the report."""

    file: str
    number: int  # 1-based
    text: str  # without its newline


@dataclass(frozen=True)
class Site:
    """A span of one file's text where a value is written.

    `start`/`end` index the text as the caller passed it (a `str`); `byte_start`/`byte_end`
    index its UTF-8 encoding (`surrogateescape` for bytes that are not UTF-8), so either can be
    spliced. `text` is the span's own text: splicing it back changes nothing.
    """

    file: str
    start: int
    end: int
    byte_start: int
    byte_end: int
    line: Line
    form: Form
    text: str
    within: Form | None = None  # the shell context around a config scalar (a heredoc body)


@dataclass(frozen=True)
class Occurrence:
    """One place that gives a knob a value."""

    knob: Knob
    value: str  # as the program reads it; runtime parts as the script writes them
    status: Status  # FOUND, RUNTIME or INVALID
    effect: Effect
    basis: Basis
    source: str  # what names the value: `--micro-batch-size`, `zero_optimization.stage in ds.json`
    site: Site | None  # where the literal (for RUNTIME: the expression) is written; None when
    # the value is assembled from pieces or computed
    pieces: tuple[Site, ...] = ()  # the literal parts of an assembled value (a path from variables)
    via: tuple[Line, ...] = ()  # the lines the value passed through, outermost first
    presence: bool = False  # the value is a flag's presence (`--gradient_checkpointing`)
    reason: str = ""  # for RUNTIME and INVALID: what the value depends on, or what is wrong

    def lines(self) -> tuple[Line, ...]:
        """Every line this occurrence touches: where it is used, passed through and written."""
        written = tuple(site.line for site in (self.site, *self.pieces) if site is not None)
        return self.via + written


@dataclass(frozen=True)
class KnobReading:
    """Everything the script says about one knob; the first occurrence is the one that wins."""

    knob: Knob
    status: Status
    value: str | None  # the winning value (RUNTIME: its expression); None when NOT_FOUND
    occurrences: tuple[Occurrence, ...]
    reason: str  # in words: where the value comes from, or why there is none
    unlisted: int = 0  # places past MAX_OCCURRENCES, not read into occurrences (a hostile
    # script's thousands of copies of one flag): a change could not reach them all

    @property
    def winner(self) -> Occurrence | None:
        return self.occurrences[0] if self.occurrences else None


@dataclass(frozen=True)
class Insertion:
    """Where new text can go without changing what the rest of the script does."""

    file: str
    offset: int | None  # index into that file's text; None when there is no safe place
    form: Form | None  # how inserted text is read there
    line: Line | None
    why: str  # why here, or why nowhere
    newline_before: bool = False  # the file ends without a newline at this offset


@dataclass(frozen=True)
class Directive:
    """One #SBATCH option that Slurm reads."""

    option: str  # long name without dashes: `nodes`, `gres`, `gpus-per-node`
    value: str
    site: Site | None  # the value's span; None for a flag without a value
    group: int  # heterogeneous job component, 0 unless `#SBATCH hetjob` came before


@dataclass(frozen=True)
class Launch:
    """A command that starts training (or a script that does, when it was not given)."""

    launcher: str  # torchrun, accelerate, deepspeed, composer, python, tune, wrapper...
    program: str  # the training script or module as the launcher receives it
    line: Line  # the top-level line the command is started from
    primary: bool  # the launch whose knobs are read (others: data preparation, servers)
    args_end: Insertion  # where a flag can be appended to the program's arguments
    het_group: int = 0
    resume_flags: tuple[str, ...] = ()  # resume flags already there (`--resume_from_checkpoint`)


@dataclass(frozen=True)
class ConfigUse:
    """A config file the script names, read from the files given with it: the key its values'
    sites carry, and where the script writes the path (so that a copy can be named instead)."""

    file: str  # the path as `files` keys it, and the `file` of the sites of its values
    source: str  # what names it: `--deepspeed_config`, `deepspeed in a.yaml`
    site: Site | None  # the path's text when it is written in one place; None when assembled
    pieces: tuple[Site, ...] = ()  # the written parts of an assembled path


@dataclass(frozen=True)
class Analysis:
    """The knobs of one script: values, places, launches, and what could not be read."""

    knobs: tuple[KnobReading, ...]  # one per Knob, in the enum's order
    launches: tuple[Launch, ...]
    directives: tuple[Directive, ...]
    env_insertion: Insertion  # after the #SBATCH header: where an `export` line can go
    files_read: tuple[str, ...]
    files_wanted: tuple[str, ...]  # paths the script names that were not given (read and retry)
    notes: tuple[str, ...]
    config_uses: tuple[ConfigUse, ...] = ()  # each place a config read from `files` is named

    def reading(self, knob: Knob) -> KnobReading:
        return next(reading for reading in self.knobs if reading.knob is knob)
