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

The walk is here; what it leans on is beside it: the #SBATCH header's options and knobs
(`allocation`), a command's words (`arguments`), which place wins (`readings`) and where each
is written (`places`). The walk stays one piece of some 700 lines: its handlers of launches and
of config files are callbacks of one evaluation that share what it has read, wanted and found
so far, and a config file may name another config that is read the same way.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from daemon.importer.allocation import JobHeader
from daemon.importer.arguments import (
    OVERRIDE,
    het_group,
    launcher_of,
    override_list,
    owner_relative,
    parse_arguments,
    python_program,
)
from daemon.importer.configs import (
    MAX_CONFIG_ENTRIES,
    ConfigFormat,
    Entry,
    format_of,
    read_config,
)
from daemon.importer.directives import read_header
from daemon.importer.evaluate import ArgsEnd, Call, Evaluator, Missing, resolve
from daemon.importer.expansion import TOO_MUCH, Env, Shell, Var
from daemon.importer.lexer import check_input, input_problem
from daemon.importer.places import Places
from daemon.importer.readings import (
    CARRIER_KNOBS,
    RANK_ARGUMENT,
    RANK_CONFIG,
    RANK_ENVIRONMENT,
    RANK_LAUNCHER,
    RANK_TOPOLOGY,
    Carrier,
    Found,
    FoundMaker,
    disagreements,
    plausible,
    read_knob,
    without_fallbacks,
)
from daemon.importer.records import (
    MAX_INPUT_CHARS,
    Analysis,
    Basis,
    ConfigUse,
    Form,
    ImporterError,
    Knob,
    Launch,
)
from daemon.importer.values import Text, concat
from daemon.importer.vocabulary import (
    ACCELERATE_KEYS,
    ALLOC_CONF_VARIABLES,
    AUXILIARY,
    CONFIG_FLAGS,
    CONFIG_SUFFIXES,
    DEEPSPEED_KEYS,
    LAUNCHERS,
    LIGHTNING_DEEPSPEED_VARIABLE,
    OVERRIDE_LIST_FLAGS,
    RESUME_NAMES,
    TRAINING,
    LauncherKind,
    LauncherOptions,
    Name,
    lightning_stage,
    lookup,
    normalise,
)

_STRATEGY_KEY = "argument strategy"  # Lightning's deepspeed_stage_N
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
_INTERPOLATION = re.compile(r"\$\{(?P<path>[A-Za-z_][\w.-]*)\}")
_MAX_INTERPOLATION_HOPS = 8
MAX_INTERPOLATED_SEGMENTS = 50_000  # what interpolations build in one config, in all
_MAX_CONFIG_HOPS = 4  # a config naming a config naming a config...
MAX_CONFIG_CHARS = 8 * MAX_INPUT_CHARS  # config text read in one analysis, each use counted


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
        problem = input_problem(text)
        if problem is not None:
            notes.append(f"{path}: not read ({problem})")
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
class _LaunchInfo:
    kind: LauncherKind
    program: str
    anchor_file: str
    anchor_offset: int
    args_end: ArgsEnd
    found: list[Found] = field(default_factory=list)
    carriers: list[Carrier] = field(default_factory=list)
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
                hidden |= CARRIER_KNOBS[carrier.kind]
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
        self.places = Places(self.texts)
        self.finds = FoundMaker()
        self.launches: list[_LaunchInfo] = []
        self.wanted: list[str] = []
        self.wanted_set: set[str] = set()
        self.read: list[str] = []
        self.sourced: list[Carrier] = []  # scripts sourced but not given: they may set anything
        self.config_uses: list[ConfigUse] = []
        self.config_chars = 0  # of the configs read, each time it is named

    # ------------------------------------------------------------ the walk

    def run(self) -> Analysis:
        header = read_header(self.script)
        self.notes.extend(header.notes)
        job_header = JobHeader(header, self.name, self.script, self.places)
        directives = job_header.directives()
        evaluator = Evaluator(self.files, self._on_call, self._on_missing)
        shell = Shell(Env(job_header.slurm_environment()), positional=None)
        evaluator.run_file(self.name, self.script, shell)
        self.notes.extend(evaluator.notes)
        if shell.work.exhausted:
            self.notes.append(f"some values are {TOO_MUCH}")
        for path in evaluator.files_read:
            self._mark_read(path)
        primary = self._primary()
        group = primary[0].het_group if primary else 0
        found = job_header.found(group, self.finds)
        for launch in primary:
            found.extend(launch.found)
            found.extend(self._alloc_conf(launch))
        carriers = [*self.sourced, *(carrier for launch in primary for carrier in launch.carriers)]
        readings = tuple(read_knob(knob, found, carriers, self.places) for knob in Knob)
        self.notes.extend(disagreements(readings))
        launches = tuple(self._launch_record(launch, launch in primary) for launch in self.launches)
        if not launches:
            self.notes.append("no command that starts training was found")
        return Analysis(
            knobs=readings,
            launches=launches,
            directives=directives,
            env_insertion=job_header.env_insertion(),
            files_read=tuple(self.read),
            files_wanted=tuple(self.wanted),
            notes=tuple(dict.fromkeys(self.notes)),
            config_uses=tuple(dict.fromkeys(self.config_uses)),
        )

    def _mark_read(self, path: str) -> None:
        if path not in self.read:
            self.read.append(path)

    def _want(self, path: str) -> None:
        if path not in self.wanted_set and path not in self.files:  # a set: 20,000 `source`s
            self.wanted.append(path)
            self.wanted_set.add(path)

    def _want_path(self, path: Text, resolved: str | None) -> None:
        """Ask for a file the script names: resolved, or as written when what is missing is
        only the owner's name or home (`/home/$USER/...`, `~/...`), which the caller knows."""
        if resolved is not None:
            self._want(resolved)
        elif owner_relative(path):
            self._want(path.plain)

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
        carrier = Carrier(
            "wrapper",
            f"the job {what} {missing.path.plain}, which was not given",
            missing.path.plain,
            missing.path,
        )
        if missing.sourced:
            self.sourced.append(carrier)
            return
        training = bool(TRAINING.search(posixpath.basename(missing.path.plain))) or any(
            argument.plain.lower().endswith(CONFIG_SUFFIXES) or OVERRIDE.match(argument.plain)
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
        kind, index = launcher_of(base, fields)
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
        launch.het_group = het_group(call.before)
        if kind is LauncherKind.PYTHON:
            kind, index, module = python_program(fields, index)
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
                Carrier(
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
                rank = RANK_TOPOLOGY if knob_name.topology else RANK_LAUNCHER
                launch.found.append(
                    self.finds.make(
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
        parsed = parse_arguments(arguments)
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
                    Carrier(
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
                for key, value in override_list(item.value):
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
        launch.found[:] = without_fallbacks(launch.found)

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
                self.finds.make(
                    Name(Knob.ZERO_STAGE, Basis.FRAMEWORK),
                    stage,
                    source=display,
                    rank=RANK_LAUNCHER,
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
        rank = RANK_TOPOLOGY if name.topology else RANK_ARGUMENT
        launch.found.append(
            self.finds.make(
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
        known_path = resolved is not None or owner_relative(path)
        if content is None and known_path and key in self.files:
            content = Text.written(key, 0, self.files[key], Form.JSON)
            self._mark_read(key)
            site, pieces = self.places.value_sites(path, None)
            self.config_uses.append(ConfigUse(key, flag, site, pieces))
        if content is None:
            if kind == "directory":
                what = f"{flag} {path.plain}: a directory of configs"
            elif not known_path:
                what = f"{flag} {path.plain} is only known at run time"
            else:
                what = f"{flag} {path.plain} was not given"
                self._want_path(path, resolved)
            launch.carriers.append(Carrier(carrier_kind, what, path.plain, path))
            return
        config_format = format_of(key) or (
            ConfigFormat.JSON if content.plain.lstrip().startswith("{") else ConfigFormat.YAML
        )
        if content.segs and content.segs[0].form is Form.JSON and len(content.segs) == 1:
            seg = content.segs[0]
            content = Text.written(seg.file or key, 0, seg.text, config_format.form)
        self.config_chars += len(content.plain)
        if self.config_chars > MAX_CONFIG_CHARS:  # 256 launches each naming a 1 MB config...
            what = (
                f"{flag} {path.plain} was not read: configs of over {MAX_CONFIG_CHARS} characters"
            )
            self.notes.append(what)
            launch.carriers.append(Carrier(carrier_kind, what, path.plain, path))
            return
        entries = read_config(content.plain, config_format)
        if len(entries) >= MAX_CONFIG_ENTRIES:
            self.notes.append(f"{key}: only its first {MAX_CONFIG_ENTRIES} values are read")
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
        interpolations = _Interpolations(content, by_path)
        best: dict[Knob, tuple[tuple[int, int, int], Found]] = {}
        siblings = frozenset(p[-1] for p in by_path if p)
        for number, entry in enumerate(entries):
            components = tuple(normalise(p) for p in entry.path)
            value = interpolations.entry_text(entry)
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
            if not plausible(name.knob, entry.value):
                continue
            display = f"{'.'.join(entry.path)} in {path}"
            rank = RANK_TOPOLOGY if name.topology else RANK_CONFIG
            found = self.finds.make(
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
                self.finds.make(
                    name,
                    joined,
                    source=f"job.dump_folder + checkpoint.folder in {path}",
                    rank=RANK_CONFIG,
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

    def _alloc_conf(self, launch: _LaunchInfo) -> list[Found]:
        found = []
        for variable in ALLOC_CONF_VARIABLES:
            var = launch.env.get(variable)
            if var is None:
                if variable in launch.unexported:
                    self.notes.append(f"{variable} is set but not exported: training never sees it")
                continue
            name = Name(Knob.ALLOC_CONF, Basis.ENVIRONMENT)
            found.append(
                self.finds.make(
                    name,
                    var.value,
                    source=variable,
                    rank=RANK_ENVIRONMENT,
                    key=f"environment {variable}",
                )
            )
        return found

    # ------------------------------------------------------------ which launches are read

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

    # ------------------------------------------------------------ records

    def _launch_record(self, launch: _LaunchInfo, primary: bool) -> Launch:
        line = self.places.line(launch.anchor_file, launch.anchor_offset)
        return Launch(
            launcher=launch.kind.value,
            program=launch.program,
            line=line,
            primary=primary,
            args_end=self.places.args_end(launch.args_end),
            het_group=launch.het_group,
            resume_flags=tuple(dict.fromkeys(launch.resume_flags)),
        )


class _Interpolations:
    """The scalars of one config as Texts, OmegaConf `${a.b}` interpolations of the same file
    followed. Each scalar is interpolated once per depth, and past MAX_INTERPOLATED_SEGMENTS
    in all the rest are kept as written: followed afresh at every use, `a2: ${a1}${a1}` over
    eight hops was exponential, and a value naming a long one many times quadratic."""

    def __init__(self, content: Text, by_path: Mapping[tuple[str, ...], Entry]) -> None:
        self.content = content
        self.by_path = by_path
        self.done: dict[tuple[int, int], Text] = {}  # (entry start, hops) -> its text
        self.names: dict[int, bool] = {}  # entry start -> whether its value interpolates
        self.segments = 0

    def entry_text(self, entry: Entry) -> Text:
        """The whole scalar (quotes included) when it is written in one place, else its value;
        interpolated when it names other keys."""
        if not self._interpolates(entry):
            scalar = self.content.slice(entry.start, entry.end)
            runs = scalar.runs()
            if runs is not None and len(runs) == 1 and entry.quoted:
                return scalar
            return self.content.slice(entry.value_start, entry.value_end)
        return self._interpolate(entry, 0)

    def _interpolates(self, entry: Entry) -> bool:
        known = self.names.get(entry.start)
        if known is None:
            known = self.names[entry.start] = bool(_INTERPOLATION.search(entry.value))
        return known

    def _interpolate(self, entry: Entry, hops: int) -> Text:
        inner = self.content.slice(entry.value_start, entry.value_end)
        if hops >= _MAX_INTERPOLATION_HOPS or self.segments > MAX_INTERPOLATED_SEGMENTS:
            return inner
        known = self.done.get((entry.start, hops))
        if known is not None:
            return known
        pieces: list[Text] = []
        cursor = 0
        for match in _INTERPOLATION.finditer(entry.value):
            pieces.append(inner.slice(cursor, match.start()))
            path = tuple(normalise(p) for p in match.group("path").split("."))
            target = self.by_path.get(path)
            if target is None:
                pieces.append(inner.slice(match.start(), match.end()))
            elif self._interpolates(target):
                pieces.append(self._interpolate(target, hops + 1))
            else:
                pieces.append(self.content.slice(target.value_start, target.value_end))
            cursor = match.end()
        pieces.append(inner.slice(cursor, len(inner)))
        result = concat(pieces)
        self.segments += len(result.segs)
        self.done[entry.start, hops] = result
        return result
