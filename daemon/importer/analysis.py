"""Where each knob's value really lives in an sbatch script.

`analyse` walks the script the way bash would (`evaluate`), reads each command that starts a
training program with its launcher's and framework's documented flags (`vocabulary`), follows
config files the command names (given by the caller or written by the script itself with a
here-document), and says for every knob: its value, every place it is written (the literal:
an assignment, a flag's value, a config scalar, an #SBATCH option), which place wins, and the
lines the value passed through. A value the script leaves to run time (`$1`, the environment,
a file that is not there) is reported as such with its expression; nothing is guessed, and
nothing is defaulted. Pure: the caller reads the files (`files`, path -> text) and calls again
with the paths in `files_wanted`.
"""

from __future__ import annotations

import bisect
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from daemon.importer.configs import ConfigFormat, Entry, format_of, read_config
from daemon.importer.directives import Header, RawDirective, gpu_count, read_header
from daemon.importer.evaluate import (
    WORKDIR,
    ArgsEnd,
    Call,
    Env,
    Evaluator,
    Missing,
    Shell,
    Var,
    resolve,
)
from daemon.importer.records import (
    CONFIG_FORMS,
    MAX_INPUT_CHARS,
    Analysis,
    Basis,
    ConfigUse,
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
from daemon.importer.shell import check_input
from daemon.importer.values import Text, written_length
from daemon.importer.vocabulary import (
    ACCELERATE_KEYS,
    ALLOC_CONF_VARIABLES,
    AUXILIARY,
    CONFIG_FLAGS,
    CONFIG_SUFFIXES,
    DEEPSPEED_KEYS,
    LAUNCHERS,
    LIGHTNING_DEEPSPEED_VARIABLE,
    NAMES,
    OVERRIDE_LIST_FLAGS,
    RESUME_NAMES,
    TRAINING,
    LauncherKind,
    LauncherOptions,
    Name,
    launcher_kind,
    lightning_stage,
    lookup,
    normalise,
)

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
_RANK_DIRECTIVE = 5
_RANK_ARGUMENT = 4  # the program's own flags and overrides: they win over its config file
_RANK_CONFIG = 3
_RANK_ENVIRONMENT = 3
_RANK_LAUNCHER = 2
_RANK_TOPOLOGY = 1
_STRATEGY_KEY = "argument strategy"  # Lightning's deepspeed_stage_N
# Carriers: a place a knob may be set that the analysis cannot see, most specific first.
_CARRIER_ORDER = ("deepspeed", "accelerate", "training", "wrapper", "arguments", "program")
_CARRIER_KNOBS = {
    "deepspeed": _DEEPSPEED_KNOBS,
    "accelerate": _ACCELERATE_KNOBS,
    "training": TRAINING_KNOBS,
    "wrapper": TRAINING_KNOBS | {Knob.ALLOC_CONF},
    "arguments": TRAINING_KNOBS,
    "program": TRAINING_KNOBS,
}
_DISTRIBUTED = frozenset(
    {
        LauncherKind.TORCHRUN,
        LauncherKind.ACCELERATE,
        LauncherKind.DEEPSPEED,
        LauncherKind.COMPOSER,
        LauncherKind.TUNE,
        LauncherKind.CLI,
    }
)
_PRIMARY_SCORE = 3  # a distributed launcher, a training program with a knob, or a knob
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
_WHOLE_NUMBER = re.compile(r"[0-9][0-9_]*\Z")
_OVERRIDE = re.compile(r"(?P<key>[+~]{0,2}[A-Za-z_][\w.-]*(?:\[\d+\])?)=")
_INTERPOLATION = re.compile(r"\$\{(?P<path>[A-Za-z_][\w.-]*)\}")
_MAX_INTERPOLATION_HOPS = 8
_MAX_CONFIG_HOPS = 4  # a config naming a config naming a config...
_MAX_PIECES = 64  # places of an assembled value worth reporting
_SLURM_FROM_OPTION = {
    "SLURM_NNODES": "nodes",
    "SLURM_JOB_NUM_NODES": "nodes",
    "SLURM_CPUS_PER_TASK": "cpus-per-task",
    "SLURM_NTASKS_PER_NODE": "ntasks-per-node",
    "SLURM_NTASKS": "ntasks",
    "SLURM_GPUS_PER_TASK": "gpus-per-task",
}


def analyse(
    script: str,
    *,
    name: str = "job.sbatch",
    files: Mapping[str, str] | None = None,
    knob_names: Mapping[str, Knob] | None = None,
) -> Analysis:
    """The knobs of `script`; `files` holds the other files it names (path -> text, paths as
    the script writes them, relative to the directory it is submitted from); `knob_names` maps
    a script's own flags or config keys to knobs (`{"--batch_size": Knob.MICRO_BATCH}`)."""
    check_input(script, name)
    given: dict[str, str] = {}
    notes: list[str] = []
    for path, text in (files or {}).items():
        if len(text) > MAX_INPUT_CHARS or "\0" in text:
            notes.append(f"{path}: not read (binary or over {MAX_INPUT_CHARS} characters)")
            continue
        given[posixpath.normpath(path)] = text
    users = {normalise(key): knob for key, knob in (knob_names or {}).items()}
    return _Analyser(script, name, given, users, notes).run()


def parse_knob_mapping(text: str) -> tuple[str, Knob]:
    """`micro_batch=--batch_size` -> ("--batch_size", Knob.MICRO_BATCH)."""
    knob, equals, flag = text.partition("=")
    if not equals or not flag.strip():
        raise ImporterError(f"{text!r}: expected KNOB=FLAG, e.g. micro_batch=--batch_size")
    try:
        return flag.strip(), Knob(knob.strip())
    except ValueError:
        known = ", ".join(knob.value for knob in Knob)
        raise ImporterError(f"{knob.strip()!r} is not a knob (one of {known})") from None


@dataclass
class _Found:
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
class _Carrier:
    kind: str  # one of _CARRIER_ORDER
    what: str  # in words
    expression: str
    place: Text | None


@dataclass
class _LaunchInfo:
    kind: LauncherKind
    program: str
    anchor_file: str
    anchor_offset: int
    args_end: ArgsEnd
    found: list[_Found] = field(default_factory=list)
    carriers: list[_Carrier] = field(default_factory=list)
    het_group: int = 0
    resume_flags: list[str] = field(default_factory=list)
    env: Mapping[str, Var] = field(default_factory=dict)
    unexported: frozenset[str] = frozenset()

    @property
    def score(self) -> int:
        """How much this launch looks like the training run: knobs it sets, places knobs may
        hide in, a distributed launcher, a program named like training."""
        knobs = {f.knob for f in self.found if not f.name.topology}
        hidden: set[Knob] = set()
        for carrier in self.carriers:
            if carrier.kind != "program":
                hidden |= _CARRIER_KNOBS[carrier.kind]
        score = 4 * len(knobs) + len(hidden - knobs)
        score += 3 if self.kind in _DISTRIBUTED else 0
        score += 2 if TRAINING.search(self.program) else 0
        return score + (1 if any(c.kind == "program" for c in self.carriers) else 0)

    @property
    def auxiliary(self) -> bool:
        return bool(AUXILIARY.search(self.program.lower())) and not TRAINING.search(self.program)


class _Analyser:
    def __init__(
        self,
        script: str,
        name: str,
        files: dict[str, str],
        users: dict[str, Knob],
        notes: list[str],
    ) -> None:
        self.script = script
        self.name = name
        self.files = files
        self.users = users
        self.notes = notes
        self.texts: dict[str, str] = {name: script, **files}
        self.lines = _LineIndex(self.texts)
        self.launches: list[_LaunchInfo] = []
        self.wanted: list[str] = []
        self.read: list[str] = []
        self.sourced: list[_Carrier] = []  # scripts sourced but not given: they may set anything
        self.config_uses: list[ConfigUse] = []
        self.order = 0

    # ------------------------------------------------------------ the walk

    def run(self) -> Analysis:
        header = read_header(self.script)
        self.notes.extend(header.notes)
        directives = self._directives(header)
        evaluator = Evaluator(self.files, self._on_call, self._on_missing)
        shell = Shell(Env(self._slurm_environment(header)), positional=None)
        evaluator.run_file(self.name, self.script, shell)
        self.notes.extend(evaluator.notes)
        for path in evaluator.files_read:
            self._mark_read(path)
        primary = self._primary()
        group = primary[0].het_group if primary else 0
        found = self._directive_found(header, group)
        for launch in primary:
            found.extend(launch.found)
            found.extend(self._alloc_conf(launch))
        readings = tuple(self._reading(knob, found, primary) for knob in Knob)
        self._disagreements(readings)
        launches = tuple(self._launch_record(launch, launch in primary) for launch in self.launches)
        if not launches:
            self.notes.append("no command that starts training was found")
        return Analysis(
            knobs=readings,
            launches=launches,
            directives=directives,
            env_insertion=self._env_insertion(header),
            files_read=tuple(self.read),
            files_wanted=tuple(self.wanted),
            notes=tuple(dict.fromkeys(self.notes)),
            config_uses=tuple(dict.fromkeys(self.config_uses)),
        )

    def _mark_read(self, path: str) -> None:
        if path not in self.read:
            self.read.append(path)

    def _want(self, path: str) -> None:
        if path not in self.wanted and path not in self.files:
            self.wanted.append(path)

    def _want_path(self, path: Text, resolved: str | None) -> None:
        """Ask for a file the script names: resolved, or as written when what is missing is
        only the owner's name or home (`/home/$USER/...`, `~/...`), which the caller knows."""
        if resolved is not None:
            self._want(resolved)
        elif _owner_relative(path):
            self._want(path.plain)

    # ------------------------------------------------------------ the header

    def _directives(self, header: Header) -> tuple[Directive, ...]:
        result = []
        for raw in header.directives:
            site = None
            if raw.value_start >= 0 and raw.value_end > raw.value_start:
                site = self._site(self.name, raw.value_start, raw.value_end, Form.DIRECTIVE)
            result.append(Directive(raw.option, raw.value, site, raw.group))
        return tuple(result)

    def _slurm_environment(self, header: Header) -> dict[str, Var]:
        """What Slurm sets in the job from the directives: SLURM_NNODES from --nodes..."""
        env: dict[str, Var] = {}
        first = {d.option: d for d in reversed(header.directives) if d.group == 0}
        for variable, option in _SLURM_FROM_OPTION.items():
            directive = first.get(option)
            if directive is not None and directive.value_start >= 0:
                env[variable] = Var(self._directive_text(directive), exported=True)
        gpus = self._gpu_directives(header, 0)
        if gpus:
            option, text = gpus[0]
            env["SLURM_GPUS_ON_NODE"] = Var(text, exported=True)
            if option == "gpus-per-node":
                env["SLURM_GPUS_PER_NODE"] = Var(text, exported=True)
        return env

    def _directive_text(self, directive: RawDirective) -> Text:
        return Text.written(self.name, directive.value_start, directive.value, Form.DIRECTIVE)

    def _gpu_directives(self, header: Header, group: int) -> list[tuple[str, Text]]:
        """GPUs per node from the directives, most direct first: --gpus-per-node, --gres,
        --gpus-per-task (when one task per node), --gpus (spread over the nodes)."""
        options = {d.option: d for d in reversed(header.directives) if d.group == group}
        result: list[tuple[str, Text]] = []
        for option in ("gpus-per-node", "gres", "gpus-per-task", "gpus"):
            directive = options.get(option)
            if directive is None or directive.value_start < 0:
                continue
            span = gpu_count(option, directive.value)
            if span is None:
                continue
            start = directive.value_start + span[0]
            text = Text.written(
                self.name, start, directive.value[span[0] : span[1]], Form.DIRECTIVE
            )
            if option == "gpus":  # for the whole job: per node when the node count is known
                nodes = options.get("nodes")
                if nodes is not None and not _WHOLE_NUMBER.match(nodes.value):
                    continue
                if nodes is not None and int(nodes.value) > 1:
                    text = Text.derived(str(int(text.plain) // int(nodes.value)))
            elif option == "gpus-per-task":
                tasks = _tasks_per_node(options)
                if tasks is None:
                    continue
                if tasks != 1:
                    text = Text.derived(str(int(text.plain) * tasks))
            result.append((option, text))
        return result

    def _directive_found(self, header: Header, group: int) -> list[_Found]:
        found: list[_Found] = []
        options = {d.option: d for d in reversed(header.directives) if d.group == group}
        nodes = options.get("nodes")
        if nodes is not None and nodes.value_start >= 0:
            found.append(
                self._found(
                    Name(Knob.NODES, Basis.ALLOCATION),
                    self._directive_text(nodes),
                    source=f"#SBATCH {nodes.written}",
                    rank=_RANK_DIRECTIVE,
                    key="directive",
                )
            )
        for option, text in self._gpu_directives(header, group):
            found.append(
                self._found(
                    Name(Knob.GPUS_PER_NODE, Basis.ALLOCATION),
                    text,
                    source=f"#SBATCH --{option}",
                    rank=_RANK_DIRECTIVE,
                    key=f"directive {option}",
                )
            )
        return found

    def _env_insertion(self, header: Header) -> Insertion:
        offset = header.after_last_directive
        newline_before = (
            offset == len(self.script) and not self.script.endswith("\n") and offset > 0
        )
        what = "after the #SBATCH header" if header.directives else "after the first line"
        if not header.directives and not self.script.startswith("#!"):
            what = "at the top of the script"
        line = self.lines.line(self.name, max(offset - 1, 0)) if offset else None
        return Insertion(self.name, offset, Form.SHELL_WORD, line, what, newline_before)

    # ------------------------------------------------------------ launches

    def _on_call(self, call: Call) -> None:
        launch = self._interpret(call)
        if launch is not None:
            self._lightning_deepspeed(launch, call)
            self.launches.append(launch)

    def _lightning_deepspeed(self, launch: _LaunchInfo, call: Call) -> None:
        """Lightning's DeepSpeedStrategy reads its config from PL_DEEPSPEED_CONFIG_PATH, and
        that config's stage wins over the one the strategy's name gives."""
        var = launch.env.get(LIGHTNING_DEEPSPEED_VARIABLE)
        if var is None or not any(found.key == _STRATEGY_KEY for found in launch.found):
            return
        self._config(
            launch, call, var.value, kind="deepspeed", flag=LIGHTNING_DEEPSPEED_VARIABLE, hops=0
        )

    def _on_missing(self, missing: Missing) -> None:
        """A script the job sources or runs that was not given: knobs may be set in it. A
        sourced one may set anything before the launch; a run one is a launch itself when it
        looks like training (its name, or a config or override among its arguments)."""
        self._want_path(missing.path, missing.resolved)
        what = "sources" if missing.sourced else "runs"
        carrier = _Carrier(
            "wrapper",
            f"the job {what} {missing.path.plain}, which was not given",
            missing.path.plain,
            missing.path,
        )
        if missing.sourced:
            self.sourced.append(carrier)
            return
        training = bool(TRAINING.search(posixpath.basename(missing.path.plain))) or any(
            argument.plain.lower().endswith(CONFIG_SUFFIXES) or _OVERRIDE.match(argument.plain)
            for argument in missing.arguments
        )
        launch = _LaunchInfo(
            LauncherKind.WRAPPER,
            missing.path.plain,
            missing.anchor.file,
            missing.anchor.offset,
            missing.args_end,
            carriers=[carrier] if training else [],
        )
        self.launches.append(launch)

    def _interpret(self, call: Call) -> _LaunchInfo | None:
        fields = list(call.fields)
        base = posixpath.basename(fields[0].plain)
        kind, index = _launcher_kind(base, fields)
        if kind is None:
            return None
        launch = _LaunchInfo(
            kind,
            "",
            call.anchor.file,
            call.anchor.offset,
            call.args_end,
            env=call.env,
            unexported=call.unexported,
        )
        launch.het_group = _het_group(call.before)
        if kind is LauncherKind.PYTHON:
            kind, index, module = _python(fields, index)
            if kind is None:
                return None
            launch.kind = kind
            if module is not None:
                launch.program = module
                self._arguments(launch, call, fields[index:])
                return launch
        if kind is LauncherKind.TUNE:
            index = self._options(launch, call, fields, index, LAUNCHERS[LauncherKind.TORCHRUN])
            launch.program = fields[index].plain if index < len(fields) else ""
            self._arguments(launch, call, fields[index + 1 :])
            return launch
        if kind is LauncherKind.CLI:
            launch.program = " ".join(field.plain for field in fields[:index])
            self._arguments(launch, call, fields[index:])
            return launch
        options = LAUNCHERS.get(kind)
        if options is not None and kind is not LauncherKind.PYTHON:
            index = self._options(launch, call, fields, index, options)
        if index < len(fields) and fields[index].plain in {"-m", "--module"}:
            index += 1
        if index >= len(fields):
            return launch
        program = fields[index]
        launch.program = program.plain
        if program.segs and all(seg.opaque for seg in program.segs):
            launch.carriers.append(
                _Carrier(
                    "program",
                    f"the program {program.plain} is only known at run time",
                    program.plain,
                    program,
                )
            )
        self._arguments(launch, call, fields[index + 1 :])
        return launch

    def _options(
        self,
        launch: _LaunchInfo,
        call: Call,
        fields: list[Text],
        index: int,
        options: LauncherOptions,
    ) -> int:
        """Read a launcher's own options; the index of the first field after them."""
        while index < len(fields):
            text = fields[index]
            word = text.plain
            if not word.startswith("-") or word in {"-m", "--module"}:
                return index
            raw_name, equals, _ = word.lstrip("-").partition("=")
            option = normalise(raw_name)
            value: Text | None = None
            if equals:
                value = text.slice(len(word) - len(word.lstrip("-")) + len(raw_name) + 1, len(word))
                index += 1
            elif option in options.flags:
                index += 1
                continue
            elif index + 1 < len(fields) and (
                option in options.valued
                or (
                    not fields[index + 1].plain.startswith("-")
                    and not fields[index + 1].plain.endswith(".py")
                )
            ):
                value = fields[index + 1]
                index += 2
            else:
                index += 1
                continue
            knob_name = options.knobs.get(option)
            if knob_name is not None and value is not None:
                rank = _RANK_TOPOLOGY if knob_name.topology else _RANK_LAUNCHER
                launch.found.append(
                    self._found(
                        knob_name,
                        value,
                        source=word.split("=")[0],
                        rank=rank,
                        key=f"launcher {option}",
                        use=text,
                    )
                )
            config_kind = options.configs.get(option)
            if config_kind is not None and value is not None:
                self._config(launch, call, value, kind=config_kind, flag=word.split("=")[0], hops=0)
        return index

    def _arguments(self, launch: _LaunchInfo, call: Call, arguments: list[Text]) -> None:
        """The program's own arguments: flags, key=value overrides, config files."""
        parsed = _parse_arguments(arguments)
        siblings = frozenset(normalise(item.path[-1]) for item in parsed if item.path)
        hydra_dir = next(
            (i for i in parsed if i.flag and normalise(i.display) == "config_path"), None
        )
        hydra_name = next(
            (i for i in parsed if i.flag and normalise(i.display) == "config_name"), None
        )
        for item in parsed:
            if item.opaque:
                launch.carriers.append(
                    _Carrier(
                        "arguments",
                        f"arguments {item.field.plain} are only known at run time",
                        item.field.plain,
                        item.field,
                    )
                )
                continue
            normalised = ".".join(normalise(part) for part in item.path)
            if item.flag and normalised in RESUME_NAMES:
                launch.resume_flags.append(item.display)
            if item.flag and item.value is not None and normalised in CONFIG_FLAGS:
                if normalised == "config_path" and hydra_name is not None:
                    continue
                kind = CONFIG_FLAGS[normalised]
                self._config(launch, call, item.value, kind=kind, flag=item.display, hops=0)
                continue
            if item.flag and normalised in OVERRIDE_LIST_FLAGS and item.value is not None:
                for key, value in _override_list(item.value):
                    self._argument_found(
                        launch,
                        (key,),
                        value,
                        display=f"{item.display} {key}",
                        siblings=siblings,
                        use=item.field,
                    )
                continue
            if item.positional:
                self._positional(launch, call, item.field)
                continue
            self._argument_found(
                launch,
                item.path,
                item.value,
                display=item.display,
                siblings=siblings,
                use=item.field,
            )
        if (
            hydra_dir is not None
            and hydra_dir.value is not None
            and hydra_name is not None
            and hydra_name.value is not None
        ):
            name = hydra_name.value.plain
            path = hydra_dir.value + Text.derived("/" + (name if "." in name else name + ".yaml"))
            self._config(
                launch, call, path, kind="training", flag="--config-path/--config-name", hops=0
            )
        launch.found[:] = _without_fallbacks(launch.found)

    def _positional(self, launch: _LaunchInfo, call: Call, value: Text) -> None:
        plain = value.plain
        python_config = (
            plain.endswith(".py") and launch.program.endswith(".py") and plain != launch.program
        )
        if plain.lower().endswith(CONFIG_SUFFIXES) or python_config:
            self._config(
                launch, call, value, kind="training", flag="the configuration argument", hops=0
            )

    def _argument_found(
        self,
        launch: _LaunchInfo,
        path: tuple[str, ...],
        value: Text | None,
        *,
        display: str,
        siblings: frozenset[str],
        use: Text,
    ) -> None:
        components = tuple(normalise(part) for part in path)
        stage = lightning_stage(value) if components[-1:] == ("strategy",) and value else None
        if stage is not None:
            # a default the DeepSpeed config's own stage overrides: ranked below it
            launch.found.append(
                self._found(
                    Name(Knob.ZERO_STAGE, Basis.FRAMEWORK),
                    stage,
                    source=display,
                    rank=_RANK_LAUNCHER,
                    key=_STRATEGY_KEY,
                    use=use,
                )
            )
            return
        name = lookup(components, self.users, siblings=siblings)
        if name is None:
            return
        if value is None and not (name.presence or name.knob is Knob.RECOMPUTE):
            return
        rank = _RANK_TOPOLOGY if name.topology else _RANK_ARGUMENT
        launch.found.append(
            self._found(
                name,
                value,
                source=display,
                rank=rank,
                key=f"argument {'.'.join(components)}",
                use=use,
            )
        )

    # ------------------------------------------------------------ config files

    def _config(
        self, launch: _LaunchInfo, call: Call, path: Text, *, kind: str, flag: str, hops: int
    ) -> None:
        carrier_kind = {"deepspeed": "deepspeed", "accelerate": "accelerate"}.get(kind, "training")
        resolved = resolve(path, call.cwd)
        key = resolved if resolved is not None else path.plain
        content: Text | None = call.virtual.get(key) or call.virtual.get(path.plain)
        known_path = resolved is not None or _owner_relative(path)
        if content is None and known_path and key in self.files:
            content = Text.written(key, 0, self.files[key], Form.JSON)
            self._mark_read(key)
            site, pieces = self._value_sites(path, None)
            self.config_uses.append(ConfigUse(key, flag, site, pieces))
        if content is None:
            if kind == "directory":
                what = f"{flag} {path.plain}: a directory of configs"
            elif not known_path:
                what = f"{flag} {path.plain} is only known at run time"
            else:
                what = f"{flag} {path.plain} was not given"
                self._want_path(path, resolved)
            launch.carriers.append(_Carrier(carrier_kind, what, path.plain, path))
            return
        config_format = format_of(key) or (
            ConfigFormat.JSON if content.plain.lstrip().startswith("{") else ConfigFormat.YAML
        )
        if content.segs and content.segs[0].form is Form.JSON and len(content.segs) == 1:
            seg = content.segs[0]
            content = Text.written(seg.file or key, 0, seg.text, config_format.form)
        entries = read_config(content.plain, config_format)
        self._config_entries(
            launch,
            call,
            content,
            entries=entries,
            config_format=config_format,
            kind=kind,
            path=key,
            hops=hops,
        )

    def _config_entries(
        self,
        launch: _LaunchInfo,
        call: Call,
        content: Text,
        *,
        entries: list[Entry],
        config_format: ConfigFormat,
        kind: str,
        path: str,
        hops: int,
    ) -> None:
        by_path = {tuple(normalise(p) for p in entry.path): entry for entry in entries}
        best: dict[Knob, tuple[tuple[int, int, int], _Found]] = {}
        siblings = frozenset(p[-1] for p in by_path if p)
        for number, entry in enumerate(entries):
            components = tuple(normalise(p) for p in entry.path)
            value = _entry_text(content, entry, by_path)
            if (
                kind in {"training", "accelerate"}
                and components
                and components[-1]
                in {
                    "deepspeed",
                    "deepspeed_config_file",
                }
            ):
                if value.plain.lower().endswith(".json") and hops < _MAX_CONFIG_HOPS:
                    self._config(
                        launch,
                        call,
                        value,
                        kind="deepspeed",
                        flag=f"{'.'.join(entry.path)} in {path}",
                        hops=hops + 1,
                    )
                continue
            name = self._config_name(kind, components, siblings)
            if name is None:
                continue
            if entry.value.strip().lower() in {"auto", "null", "~", "none", ""}:
                continue  # DeepSpeed's "auto" defers to the framework's own flag
            if not _plausible(name.knob, entry.value):
                continue
            display = f"{'.'.join(entry.path)} in {path}"
            rank = _RANK_TOPOLOGY if name.topology else _RANK_CONFIG
            found = self._found(
                name,
                value,
                source=display,
                rank=rank,
                key=f"config {'.'.join(components)}",
                config_form=config_format,
            )
            score = (name.rank, len(components), number)
            if name.knob not in best or score < best[name.knob][0]:
                best[name.knob] = (score, found)
        folder = by_path.get(("checkpoint", "folder"))
        if config_format is ConfigFormat.TOML and folder is not None:
            best.pop(Knob.CHECKPOINT_DIR, None)
            dump = by_path.get(("job", "dump_folder"))
            joined = Text()
            for index, part in enumerate(e for e in (dump, folder) if e is not None):
                piece = content.slice(part.value_start, part.value_end)
                joined = joined + (Text.derived("/") if index else Text()) + piece
            name = Name(Knob.CHECKPOINT_DIR, Basis.FRAMEWORK)
            best[Knob.CHECKPOINT_DIR] = (
                (0, 0, 0),
                self._found(
                    name,
                    joined,
                    source=f"job.dump_folder + checkpoint.folder in {path}",
                    rank=_RANK_CONFIG,
                    key="config checkpoint.folder",
                    config_form=config_format,
                ),
            )
        launch.found.extend(found for _, found in best.values())

    def _config_name(
        self, kind: str, components: tuple[str, ...], siblings: frozenset[str]
    ) -> Name | None:
        if kind == "deepspeed":
            knob = DEEPSPEED_KEYS.get(components)
            return Name(knob, Basis.FRAMEWORK) if knob is not None else None
        if kind == "accelerate":
            return ACCELERATE_KEYS.get(components[-2:]) or ACCELERATE_KEYS.get(components[-1:])
        return lookup(components, self.users, siblings=siblings)

    def _alloc_conf(self, launch: _LaunchInfo) -> list[_Found]:
        found = []
        for variable in ALLOC_CONF_VARIABLES:
            var = launch.env.get(variable)
            if var is None:
                if variable in launch.unexported:
                    self.notes.append(f"{variable} is set but not exported: training never sees it")
                continue
            name = Name(Knob.ALLOC_CONF, Basis.ENVIRONMENT)
            found.append(
                self._found(
                    name,
                    var.value,
                    source=variable,
                    rank=_RANK_ENVIRONMENT,
                    key=f"environment {variable}",
                )
            )
        return found

    # ------------------------------------------------------------ readings

    def _found(
        self,
        name: Name,
        value: Text | None,
        *,
        source: str,
        rank: int,
        key: str,
        use: Text | None = None,
        config_form: ConfigFormat | None = None,
    ) -> _Found:
        self.order += 1
        return _Found(name.knob, value, name, source, rank, key, use, config_form, self.order)

    def _primary(self) -> list[_LaunchInfo]:
        """The launches whose knobs are read: those that show training settings, training
        before auxiliary work (evaluation, serving, data preparation)."""
        scored = [launch for launch in self.launches if launch.score >= _PRIMARY_SCORE]
        main = [launch for launch in scored if not launch.auxiliary] or scored
        if not main:
            plain = [launch for launch in self.launches if not launch.auxiliary]
            best = max(plain or self.launches, key=lambda launch: launch.score, default=None)
            if best is None:
                return []
            main = [best]
        groups = {launch.het_group for launch in main}
        if len(groups) > 1:
            best = max(main, key=lambda launch: launch.score)
            main = [launch for launch in main if launch.het_group == best.het_group]
        return main

    def _reading(self, knob: Knob, found: list[_Found], primary: list[_LaunchInfo]) -> KnobReading:
        candidates = [f for f in found if f.knob is knob]
        occurrences = self._occurrences(knob, candidates)
        if occurrences:
            winner = occurrences[0]
            if winner.status is Status.FOUND:
                reason = f"{winner.value} from {winner.source}"
            elif winner.status is Status.RUNTIME:
                reason = f"set at run time: {winner.reason}"
            else:
                reason = f"{winner.source}: {winner.reason}"
            value = winner.value
            return KnobReading(knob, winner.status, value, occurrences, reason)
        carrier = _best_carrier(knob, primary, self.sourced)
        if carrier is not None:
            occurrence = self._carrier_occurrence(knob, carrier)
            return KnobReading(
                knob,
                Status.RUNTIME,
                carrier.expression,
                (occurrence,),
                f"set at run time: {carrier.what}",
            )
        return KnobReading(knob, Status.NOT_FOUND, None, (), "not set by the script")

    def _occurrences(self, knob: Knob, candidates: list[_Found]) -> tuple[Occurrence, ...]:
        if not candidates:
            return ()
        ordered = sorted(candidates, key=lambda f: (f.rank, -f.name.rank, f.order), reverse=True)
        winner = ordered[0]
        result: list[Occurrence] = []
        seen: set[tuple[str, int, int]] = set()
        for found in ordered:
            effect = Effect.WINS if found is winner else self._effect(found, winner)
            occurrence = self._occurrence(knob, found, effect)
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
        return tuple(result)

    @staticmethod
    def _effect(found: _Found, winner: _Found) -> Effect:
        if found.key == winner.key and found.rank == winner.rank:
            return Effect.OVERRIDDEN
        if winner.rank == _RANK_ARGUMENT and found.key.startswith("config"):
            return Effect.OVERRIDDEN
        return Effect.MIRROR

    def _occurrence(self, knob: Knob, found: _Found, effect: Effect) -> Occurrence | None:
        via = self._via(found)
        if found.value is None:
            site = self._text_site(found.use) if found.use is not None else None
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
            if place.file is not None and place.file in self.texts:
                site = self._site(
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
        if status is Status.FOUND and not _plausible(knob, value):
            return None
        site, pieces = self._value_sites(text, found.config_form)
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

    def _value_sites(
        self, text: Text, config_form: ConfigFormat | None
    ) -> tuple[Site | None, tuple[Site, ...]]:
        """The one place a value is written, or the pieces of an assembled one."""
        runs = text.runs()
        whole = runs is not None
        if runs is None:
            runs = text.located_runs()
        if len(runs) > _MAX_PIECES:
            return None, ()
        sites = []
        for run in runs:
            form = run.form or Form.SHELL_WORD
            within = None
            if config_form is not None and form in {Form.HEREDOC, Form.HEREDOC_LITERAL}:
                within, form = form, config_form.form
            sites.append(self._site(run.file, run.start, run.end, form, within))
        if whole and len(sites) == 1:
            return sites[0], ()
        return None, tuple(dict.fromkeys(sites))

    def _via(self, found: _Found) -> tuple[Line, ...]:
        lines: list[Line] = []
        if found.use is not None:
            origin = found.use.origin_at(0)
            if origin is not None and origin[0] in self.texts:
                lines.append(self.lines.line(origin[0], origin[1]))
            if found.use.segs:
                for frame in found.use.segs[0].frames:
                    lines.append(self.lines.line(frame.file, frame.start))
        if found.value is not None:
            for seg in [*found.value.segs[:1], *found.value.unknowns()[:1]]:
                for frame in seg.frames:
                    if frame.file in self.texts:
                        lines.append(self.lines.line(frame.file, frame.start))
        return tuple(dict.fromkeys(lines))

    def _carrier_occurrence(self, knob: Knob, carrier: _Carrier) -> Occurrence:
        site: Site | None = None
        pieces: tuple[Site, ...] = ()
        lines: list[Line] = []
        if carrier.place is not None:
            site = self._text_site(carrier.place)
            if site is None:
                _, pieces = self._value_sites(carrier.place, None)
            for seg in carrier.place.segs:
                lines.extend(
                    self.lines.line(f.file, f.start) for f in seg.frames if f.file in self.texts
                )
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

    def _text_site(self, text: Text) -> Site | None:
        """Where a text is written, when it is written in one place (or is one expression)."""
        runs = text.runs()
        if runs is not None and len(runs) == 1 and runs[0].file in self.texts:
            run = runs[0]
            return self._site(run.file, run.start, run.end, run.form or Form.SHELL_WORD)
        if len(text.segs) == 1 and text.segs[0].opaque:
            seg = text.segs[0]
            if seg.file is not None and seg.file in self.texts:
                end = seg.start + written_length(seg)
                return self._site(seg.file, seg.start, end, seg.form or Form.SHELL_WORD)
        return None

    def _site(
        self, file: str, start: int, end: int, form: Form, within: Form | None = None
    ) -> Site:
        text = self.texts[file]
        byte_start, byte_end = self.lines.bytes(file, start), self.lines.bytes(file, end)
        return Site(
            file,
            start,
            end,
            byte_start,
            byte_end,
            self.lines.line(file, start),
            form,
            text[start:end],
            within,
        )

    def _disagreements(self, readings: tuple[KnobReading, ...]) -> None:
        for reading in readings:
            if reading.status is not Status.FOUND:
                continue
            for occurrence in reading.occurrences[1:]:
                if (
                    occurrence.effect is Effect.MIRROR
                    and occurrence.status is Status.FOUND
                    and occurrence.value != reading.value
                ):
                    self.notes.append(
                        f"{reading.knob.value}: {reading.value} from {reading.winner.source}"  # type: ignore[union-attr]
                        f" but {occurrence.value} from {occurrence.source}"
                    )

    # ------------------------------------------------------------ records

    def _launch_record(self, launch: _LaunchInfo, primary: bool) -> Launch:
        line = self.lines.line(launch.anchor_file, launch.anchor_offset)
        return Launch(
            launcher=launch.kind.value,
            program=launch.program,
            line=line,
            primary=primary,
            args_end=self._args_end(launch.args_end),
            het_group=launch.het_group,
            resume_flags=tuple(dict.fromkeys(launch.resume_flags)),
        )

    def _args_end(self, ends: ArgsEnd) -> Insertion:
        """Where a flag can be appended to a command's arguments: after its last word, before
        any redirection, pipe or `&&`. Inside a command built from strings, after the outermost
        `$X` whose value ends with that word (and no newline, which would end the command when
        the string is read as code), else right after the word where it is written."""
        source = ends.source
        mapped = source.mapped
        if mapped is None:
            line = self.lines.line(source.file, max(ends.offset - 1, 0))
            return Insertion(
                source.file, ends.offset, Form.SHELL_WORD, line, "after the command's last argument"
            )
        index = ends.offset - 1
        if index < 0:
            return Insertion(source.file, None, None, None, "the command has no arguments")
        for frame in mapped.frames_at(index):
            ends_here = frame.offset == frame.last and not frame.tail_newline
            if ends_here and frame.file in self.texts:
                line = self.lines.line(frame.file, frame.start)
                return Insertion(
                    frame.file,
                    frame.end,
                    frame.form,
                    line,
                    "after the variable that ends the command's arguments",
                )
        end = mapped.end_at(index)
        if end is None or end[0] not in self.texts:
            return Insertion(
                source.file,
                None,
                None,
                None,
                "the command's last argument is computed, not written in the script",
            )
        file, offset, form = end
        line = self.lines.line(file, max(offset - 1, 0))
        return Insertion(file, offset, form, line, "after the command's last argument")


# ---------------------------------------------------------------- argument parsing


@dataclass(frozen=True)
class _Argument:
    field: Text
    path: tuple[str, ...]  # key path of a flag or an override
    display: str  # the flag or key as written
    value: Text | None  # None: a flag's presence
    flag: bool = False
    positional: bool = False
    opaque: bool = False  # a field that may expand to any arguments at run time


def _parse_arguments(arguments: list[Text]) -> list[_Argument]:
    parsed: list[_Argument] = []
    index = 0
    while index < len(arguments):
        current = arguments[index]
        word = current.plain
        index += 1
        first = current.segs[0] if current.segs else None
        # A word that starts with the working directory or the owner's home is one path.
        if first is not None and first.opaque and first.why != WORKDIR and first.text not in _OWNER:
            parsed.append(_Argument(current, (), word, None, opaque=True))
            continue
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            stripped = word.lstrip("-")
            name, equals, _ = stripped.partition("=")
            dashes = len(word) - len(stripped)
            value: Text | None = None
            if equals:
                value = current.slice(dashes + len(name) + 1, len(word))
            elif (
                index < len(arguments)
                and (
                    not arguments[index].plain.startswith("-") or _is_number(arguments[index].plain)
                )
                and lookup_presence(name) is False
            ):
                value = arguments[index]
                index += 1
            display = word[: dashes + len(name)]
            if value is not None and len(name) <= 2 and (inner := _OVERRIDE.match(value.plain)):
                key = inner.group("key").lstrip("+~")
                parsed.append(
                    _Argument(
                        current,
                        tuple(key.split(".")),
                        key,
                        value.slice(inner.end(), len(value)),
                        flag=False,
                    )
                )
                continue
            parsed.append(_Argument(current, tuple(name.split(".")), display, value, flag=True))
            continue
        override = _OVERRIDE.match(word)
        if override:
            key = override.group("key").lstrip("+~")
            path = tuple(re.sub(r"\[\d+\]\Z", "", key).split("."))
            parsed.append(_Argument(current, path, key, current.slice(override.end(), len(word))))
            continue
        parsed.append(_Argument(current, (), word, current, positional=True))
    return parsed


def lookup_presence(name: str) -> bool:
    """Whether a flag never takes a value (`--checkpoint-activations`)."""
    known = NAMES.get(normalise(name))
    return known is not None and known.presence


def _is_number(word: str) -> bool:
    return bool(re.fullmatch(r"-?[0-9][0-9._e+-]*", word))


def _override_list(value: Text) -> list[tuple[str, Text]]:
    """`a=1,b=2` -> [(a, 1), (b, 2)], with each value's provenance."""
    result = []
    position = 0
    for chunk in value.plain.split(","):
        key, equals, _ = chunk.partition("=")
        if equals and key.strip():
            start = position + len(key) + 1
            result.append((key.strip(), value.slice(start, position + len(chunk))))
        position += len(chunk) + 1
    return result


def _launcher_kind(base: str, fields: list[Text]) -> tuple[LauncherKind | None, int]:
    found = launcher_kind(base, fields[1].plain if len(fields) > 1 else "")
    return found if found is not None else (None, 0)


_MODULE_LAUNCHERS = {
    "torch.distributed.run": LauncherKind.TORCHRUN,
    "torch.distributed.launch": LauncherKind.TORCHRUN,
    "accelerate.commands.launch": LauncherKind.ACCELERATE,
    "deepspeed.launcher.runner": LauncherKind.DEEPSPEED,
    "composer.cli.launcher": LauncherKind.COMPOSER,
}


def _python(fields: list[Text], index: int) -> tuple[LauncherKind | None, int, str | None]:
    """After `python`: its own options, then `-m module` or the script. Returns the launcher
    the module is (torch.distributed.run...) with the index after it, or PYTHON with the
    script's index, and the module name when the program is a module."""
    options = LAUNCHERS[LauncherKind.PYTHON]
    while index < len(fields):
        word = fields[index].plain
        if word == "-m" and index + 1 < len(fields):
            module = fields[index + 1].plain
            launcher = _MODULE_LAUNCHERS.get(module)
            if launcher is not None:
                return launcher, index + 2, None
            return LauncherKind.PYTHON, index + 2, module
        if word == "-c":
            return None, index, None
        if not word.startswith("-"):
            return LauncherKind.PYTHON, index, None
        letters = word.lstrip("-").lower()
        index += 2 if letters in options.valued else 1
    return None, index, None


def _het_group(before: tuple[Text, ...]) -> int:
    for index, text in enumerate(before):
        word = text.plain
        for prefix in ("--het-group", "--pack-group"):
            if word.startswith(prefix + "="):
                number = word.split("=", 1)[1].split(",")[0]
                return int(number) if number.isdigit() else 0
            if word == prefix and index + 1 < len(before):
                number = before[index + 1].plain.split(",")[0]
                return int(number) if number.isdigit() else 0
    return 0


def _tasks_per_node(options: Mapping[str, RawDirective]) -> int | None:
    per_node = options.get("ntasks-per-node")
    if per_node is not None and _WHOLE_NUMBER.match(per_node.value):
        return int(per_node.value)
    tasks, nodes = options.get("ntasks"), options.get("nodes")
    if tasks is not None and _WHOLE_NUMBER.match(tasks.value):
        if nodes is not None and _WHOLE_NUMBER.match(nodes.value) and int(nodes.value):
            return max(int(tasks.value) // int(nodes.value), 1)
        return int(tasks.value) if nodes is None else None
    return 1


def _entry_text(content: Text, entry: Entry, by_path: Mapping[tuple[str, ...], Entry]) -> Text:
    """A config scalar as a Text: the whole scalar (quotes included) when it is written in
    one place, with OmegaConf `${a.b}` interpolations of the same file followed."""
    scalar = content.slice(entry.start, entry.end)
    inner = content.slice(entry.value_start, entry.value_end)
    if not _INTERPOLATION.search(entry.value):
        runs = scalar.runs()
        return scalar if runs is not None and len(runs) == 1 and entry.quoted else inner
    return _interpolate(content, entry, by_path, 0)


def _interpolate(
    content: Text, entry: Entry, by_path: Mapping[tuple[str, ...], Entry], hops: int
) -> Text:
    inner = content.slice(entry.value_start, entry.value_end)
    if hops >= _MAX_INTERPOLATION_HOPS:
        return inner
    result = Text()
    cursor = 0
    for match in _INTERPOLATION.finditer(entry.value):
        result = result + inner.slice(cursor, match.start())
        target = by_path.get(tuple(normalise(p) for p in match.group("path").split(".")))
        if target is None:
            result = result + inner.slice(match.start(), match.end())
        elif _INTERPOLATION.search(target.value):
            result = result + _interpolate(content, target, by_path, hops + 1)
        else:
            result = result + content.slice(target.value_start, target.value_end)
        cursor = match.end()
    return result + inner.slice(cursor, len(inner))


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
        if _WHOLE_NUMBER.match(value):
            return str(int(value)), ""
        return value, f"{value!r} is not a whole number"
    if knob is Knob.RECOMPUTE:
        return _BOOLEAN.get(value.lower(), value), ""
    return value, ""


_OWNER = frozenset({"$USER", "${USER}", "$HOME", "${HOME}", "$LOGNAME", "${LOGNAME}"})


def _owner_relative(path: Text) -> bool:
    """A path whose only unknown parts are the owner's name or home directory."""
    unknowns = path.unknowns()
    if unknowns:
        return all(seg.text in _OWNER for seg in unknowns)
    return path.plain.startswith("~/")


def _plausible(knob: Knob, value: str) -> bool:
    """`save: true`, `save: 1000`: a switch or an interval, not a checkpoint directory."""
    if knob is not Knob.CHECKPOINT_DIR:
        return True
    plain = value.strip().strip("'\"").lower()
    return plain not in _BOOLEAN and not _WHOLE_NUMBER.match(plain)


def _best_carrier(
    knob: Knob, primary: list[_LaunchInfo], sourced: list[_Carrier]
) -> _Carrier | None:
    carriers = [c for launch in primary for c in launch.carriers]
    carriers = [c for c in (*sourced, *carriers) if knob in _CARRIER_KNOBS[c.kind]]
    if not carriers:
        return None
    return min(carriers, key=lambda c: _CARRIER_ORDER.index(c.kind))


def _without_fallbacks(found: list[_Found]) -> list[_Found]:
    """A fallback name (Lightning's default_root_dir beside a ModelCheckpoint's dirpath) names
    another place when a firmer name of its knob is set: it is no copy that must agree."""
    firm = {f.knob for f in found if not f.name.fallback}
    return [f for f in found if not (f.name.fallback and f.knob in firm)]


def _with_effect(occurrence: Occurrence, effect: Effect) -> Occurrence:
    return replace(occurrence, effect=effect)


class _LineIndex:
    """Line numbers and UTF-8 byte offsets of the files, computed once per file."""

    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts
        self.starts: dict[str, list[int]] = {}
        self.byte_starts: dict[str, list[int]] = {}

    def _index(self, file: str) -> tuple[list[int], list[int]]:
        if file not in self.starts:
            text = self.texts[file]
            starts = [0]
            byte_starts = [0]
            for line in text.split("\n"):
                starts.append(starts[-1] + len(line) + 1)
                byte_starts.append(byte_starts[-1] + len(_encode(line)) + 1)
            self.starts[file] = starts
            self.byte_starts[file] = byte_starts
        return self.starts[file], self.byte_starts[file]

    def line(self, file: str, offset: int) -> Line:
        starts, _ = self._index(file)
        number = bisect.bisect_right(starts, offset) - 1
        number = min(max(number, 0), len(starts) - 2)
        text = self.texts[file]
        end = text.find("\n", starts[number])
        return Line(file, number + 1, text[starts[number] : len(text) if end < 0 else end])

    def bytes(self, file: str, offset: int) -> int:
        starts, byte_starts = self._index(file)
        number = min(max(bisect.bisect_right(starts, offset) - 1, 0), len(starts) - 2)
        text = self.texts[file]
        return byte_starts[number] + len(_encode(text[starts[number] : offset]))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
