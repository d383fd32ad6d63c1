"""What an sbatch script's #SBATCH header gives the analysis: the options Slurm reads, the
environment Slurm sets in the job from them (SLURM_NNODES from --nodes...), the knobs they set
(nodes, GPUs per node from whichever of four options says it), and where new lines can go.

The header is read once (`directives.read_header`); the walk (`analysis`) runs the script in
the environment this gives and ranks these knobs above any other place (`RANK_DIRECTIVE`).
"""

from __future__ import annotations

from collections.abc import Mapping

from daemon.importer.directives import Header, RawDirective, gpu_count
from daemon.importer.expansion import Var
from daemon.importer.places import Places
from daemon.importer.readings import RANK_DIRECTIVE, Found, FoundMaker
from daemon.importer.records import Basis, Directive, Form, Insertion, Knob
from daemon.importer.values import Text, whole_number
from daemon.importer.vocabulary import Name

_SLURM_FROM_OPTION = {
    "SLURM_NNODES": "nodes",
    "SLURM_JOB_NUM_NODES": "nodes",
    "SLURM_CPUS_PER_TASK": "cpus-per-task",
    "SLURM_NTASKS_PER_NODE": "ntasks-per-node",
    "SLURM_NTASKS": "ntasks",
    "SLURM_GPUS_PER_TASK": "gpus-per-task",
}


class JobHeader:
    """The #SBATCH header of the script `name`, whose sites are read from `places`."""

    def __init__(self, header: Header, name: str, script: str, places: Places) -> None:
        self.header = header
        self.name = name
        self.script = script
        self.places = places

    def directives(self) -> tuple[Directive, ...]:
        """The options Slurm reads, each with the site of its value."""
        result = []
        for raw in self.header.directives:
            site = None
            if raw.value_start >= 0 and raw.value_end > raw.value_start:
                site = self.places.site(self.name, raw.value_start, raw.value_end, Form.DIRECTIVE)
            result.append(Directive(raw.option, raw.value, site, raw.group))
        return tuple(result)

    def slurm_environment(self) -> dict[str, Var]:
        """What Slurm sets in the job from the directives: SLURM_NNODES from --nodes..."""
        env: dict[str, Var] = {}
        first = {d.option: d for d in reversed(self.header.directives) if d.group == 0}
        for variable, option in _SLURM_FROM_OPTION.items():
            directive = first.get(option)
            if directive is not None and directive.value_start >= 0:
                env[variable] = Var(self._text(directive), exported=True)
        gpus = self._gpu_directives(0)
        if gpus:
            option, text = gpus[0]
            env["SLURM_GPUS_ON_NODE"] = Var(text, exported=True)
            if option == "gpus-per-node":
                env["SLURM_GPUS_PER_NODE"] = Var(text, exported=True)
        return env

    def _text(self, directive: RawDirective) -> Text:
        return Text.written(self.name, directive.value_start, directive.value, Form.DIRECTIVE)

    def _gpu_directives(self, group: int) -> list[tuple[str, Text]]:
        """GPUs per node from the directives, most direct first: --gpus-per-node, --gres,
        --gpus-per-task (when one task per node), --gpus (spread over the nodes)."""
        options = {d.option: d for d in reversed(self.header.directives) if d.group == group}
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
            count = whole_number(text.plain)
            if option == "gpus":  # for the whole job: per node when the node count is known
                nodes = options.get("nodes")
                node_count = whole_number(nodes.value) if nodes is not None else None
                if nodes is not None and node_count is None:
                    continue
                if node_count is not None and node_count > 1:
                    if count is None:
                        continue
                    text = Text.derived(str(count // node_count))
            elif option == "gpus-per-task":
                tasks = _tasks_per_node(options)
                if tasks is None:
                    continue
                if tasks != 1:
                    if count is None:
                        continue
                    text = Text.derived(str(count * tasks))
            result.append((option, text))
        return result

    def found(self, group: int, finds: FoundMaker) -> list[Found]:
        """The knobs the directives of heterogeneous component `group` set: nodes, GPUs."""
        found: list[Found] = []
        options = {d.option: d for d in reversed(self.header.directives) if d.group == group}
        nodes = options.get("nodes")
        if nodes is not None and nodes.value_start >= 0:
            found.append(
                finds.make(
                    Name(Knob.NODES, Basis.ALLOCATION),
                    self._text(nodes),
                    source=f"#SBATCH {nodes.written}",
                    rank=RANK_DIRECTIVE,
                    key="directive",
                )
            )
        for option, text in self._gpu_directives(group):
            found.append(
                finds.make(
                    Name(Knob.GPUS_PER_NODE, Basis.ALLOCATION),
                    text,
                    source=f"#SBATCH --{option}",
                    rank=RANK_DIRECTIVE,
                    key=f"directive {option}",
                )
            )
        return found

    def env_insertion(self) -> Insertion:
        """Where `export` lines can go: after the #SBATCH header, which must stay first."""
        offset = self.header.after_last_directive
        newline_before = (
            offset == len(self.script) and not self.script.endswith("\n") and offset > 0
        )
        what = "after the #SBATCH header" if self.header.directives else "after the first line"
        if not self.header.directives and not self.script.startswith("#!"):
            what = "at the top of the script"
        line = self.places.line(self.name, max(offset - 1, 0)) if offset else None
        return Insertion(self.name, offset, Form.SHELL_WORD, line, what, newline_before)


def _tasks_per_node(options: Mapping[str, RawDirective]) -> int | None:
    per_node = options.get("ntasks-per-node")
    per_node_count = whole_number(per_node.value) if per_node is not None else None
    if per_node_count is not None:
        return per_node_count
    tasks, nodes = options.get("ntasks"), options.get("nodes")
    task_count = whole_number(tasks.value) if tasks is not None else None
    if task_count is not None:
        node_count = whole_number(nodes.value) if nodes is not None else None
        if node_count:
            return max(task_count // node_count, 1)
        return task_count if nodes is None else None
    return 1
