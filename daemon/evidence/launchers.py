"""What launchers put before a line: the prefixes that name its rank or host, and the other
marks of whose line it is (a c10 message's rank, Composer's rank blocks, a shell prompt). The
lines that say a worker died are `death_lines`'.

Data, as node-problem-detector keeps its log rules (`config/kernel-monitor.json`) apart from
the reader that applies them: each entry is a pattern with named groups and where its format
comes from (the launcher's source, or a real sample under `tests/data/real/logs/`), so a new
launcher's format is one more entry, not one more branch in the scanner.

Every pattern runs in linear time on any line: repeats are bounded, no quantified group can
match the same text two ways, and a prefix is matched only at the start of what is left of the
line. Groups: `rank`, `local_rank`, `host`, `pid`. The scanner range-checks every number it
reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class RankKind(StrEnum):
    """What a printed rank counts."""

    GLOBAL = "global"  # the job-wide rank: `[rank3]:`, Open MPI's rank, Composer's `rank3[...]`
    LOCAL = "local"  # the rank on its node: `[default3]:`, `local_rank: 3`, `--local_rank=3`
    TASK = "task"  # srun's task id (`--label`): the global rank when srun starts one per rank


@dataclass(frozen=True)
class LinePrefix:
    """A prefix put before each line of a worker's output; stripped, keeping what it names."""

    name: str
    pattern: re.Pattern[str]  # matched at the start; groups `rank`, `host`, `pid` where named
    rank_kind: RankKind | None
    source: str


HOST_PATTERN = r"[A-Za-z0-9][\w.\-]{0,252}"
IP_PATTERN = r"[0-9A-Fa-f][0-9A-Fa-f.:]{1,44}"

# In the order they are tried; the scanner strips up to `MAX_PREFIXES` of them from a line.
PREFIXES: tuple[LinePrefix, ...] = (
    LinePrefix(
        "log viewer line number",
        re.compile(r"\[[0-9]{1,12}\] (?=\[)"),
        None,
        "sample 006: `[80746] [rank0]:[E321 ...`",
    ),
    LinePrefix(
        "timestamp",
        re.compile(
            r"\[?[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:[.,][0-9]{1,9})?"
            r"(?:Z|[+-][0-9]{2}:?[0-9]{2})?(?: (?:DP|TP|PP|EP|CP)[0-9]{1,5}){0,4}\]?:?[ \t]{1,8}"
        ),
        None,
        "samples 011 (`2024-11-20 14:37:16 [rank3]:`), 019 (Composer's `... 16:03:12,379: `),"
        " 034 (`[2024-02-27T21:35:32.106313Z] `), 045, DeepSpeed's `[2023-04-14 13:11:27,885] `"
        " and SGLang's `[2025-05-27 04:36:06 DP1 TP4] ` (sgl-project/sglang#6590; its parallel"
        " ranks are group ranks, not read)",
    ),
    LinePrefix(
        "container id",
        re.compile(r"[\w.\-]{1,64} \|\| "),
        None,
        "sample 034: Determined's `fa88a9df || `",
    ),
    LinePrefix(
        "logging level",
        re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL): (?=\S)"),
        None,
        "Python logging's `LEVEL: message` (Lightning's `INFO: [rank: 1] ...`; sample 034's"
        " `WARNING: torch.distributed...`)",
    ),
    LinePrefix(
        "wrapper stream",
        re.compile(r"std(?:err|out): "),
        None,
        "sample 028: `stderr: ERROR:torch.distributed...`",
    ),
    LinePrefix(
        "ray worker",
        re.compile(
            r"\((?:[A-Za-z_][\w.:\-]{0,127} )?pid=(?P<pid>[0-9]{1,10})(?:, ip=(?P<host>"
            + IP_PATTERN
            + r"))?\)"
            r"(?: |\Z)"
        ),
        None,
        "Ray's log monitor `(pid=N, ip=IP) ` and `(Actor pid=N, ip=IP) `"
        " (python/ray/_private/log_monitor.py); samples 013, 041",
    ),
    LinePrefix(
        "ray raylet",
        re.compile(r"\(raylet(?:, ip=(?P<host>" + IP_PATTERN + r"))?\)(?: |\Z)"),
        None,
        "Ray's `(raylet) ` / `(raylet, ip=IP) `; sample 041",
    ),
    LinePrefix(
        "ucx",
        re.compile(
            r"\[(?P<host>" + HOST_PATTERN + r"):[0-9]{1,10} {0,2}:[0-9]{1,6}:[0-9]{1,10}\] "
        ),
        None,
        "UCX's `[host:pid:thread:tid] ` (ucs/debug/log.c); sample 023",
    ),
    LinePrefix(
        "slurmstepd",
        re.compile(r"slurmstepd(?:-(?P<host>" + HOST_PATTERN + r"))?: "),
        None,
        "Slurm's step daemon: `slurmstepd: error: ...`, and `slurmstepd-gpu20-15: error: ...` where"
        " the build puts the node's name into its log prefix (src/slurmd/slurmstepd/slurmstepd.c"
        " sets argv[0] `slurmstepd-<node>` for its logs); held-out sample 016",
    ),
    LinePrefix(
        "pdsh ip",
        re.compile(r"(?P<host>[0-9]{1,3}(?:\.[0-9]{1,3}){3}): "),
        None,
        "pdsh `IP: ` as DeepSpeed's multi-node runner prints it; sample 036",
    ),
    LinePrefix(
        "pdsh host",
        re.compile(r"(?![0-9]{1,7}: )(?P<host>" + HOST_PATTERN + r"): (?=\[(?:rank|default)[0-9])"),
        None,
        "pdsh `host: ` before torchrun's own prefix (digits alone are srun's label)",
    ),
    LinePrefix(
        "pdsh hostname",
        re.compile(
            r"(?!rank[0-9])(?=[0-9\-.]{0,64}[a-z])(?=[a-z\-.]{0,64}[0-9])"
            r"(?P<host>[a-z0-9][a-z0-9\-]{0,62}(?:\.[a-z0-9][a-z0-9\-]{0,62}){0,8}): (?=.)"
        ),
        None,
        "pdsh `host: ` before every line of DeepSpeed's multi-node runner (deepspeed/launcher/"
        "multinode_runner.py runs `pdsh -S -f 1024 -w hosts`): a lower-case name with a digit,"
        " unlike an exception's `RuntimeError: ` or a module path",
    ),
    LinePrefix(
        "host and rank",
        re.compile(r"\[(?P<host>" + HOST_PATTERN + r"):(?P<rank>[0-9]{1,7})\]: ?"),
        RankKind.GLOBAL,
        "sample 030: `[gpu187:2]:torch.cuda.OutOfMemoryError: ...`",
    ),
    LinePrefix(
        "open mpi tag",
        re.compile(r"\[[0-9]{1,10},(?P<rank>[0-9]{1,7})\]<std(?:out|err)>: ?"),
        RankKind.GLOBAL,
        "Open MPI `mpirun --tag-output`: `[jobid,rank]<stdout>:`",
    ),
    LinePrefix(
        "torchrun rank",
        re.compile(r"\[rank(?P<rank>[0-9]{1,7})\]: ?"),
        RankKind.GLOBAL,
        "torchrun >= 2.2 `[rankN]:` (samples 011, 012, 029, 054)",
    ),
    LinePrefix(
        "torchrun local rank",
        re.compile(r"\[default(?P<rank>[0-9]{1,7})\]: ?"),
        RankKind.LOCAL,
        "torchrun --tee `[{role}{local_rank}]:` with the default role",
    ),
    LinePrefix(
        "composer rank",
        re.compile(r"rank(?P<rank>[0-9]{1,7})\[[0-9]{1,10}\]\[[^\]\s]{1,64}\]: "),
        RankKind.GLOBAL,
        "Composer's `rank0[1003409][MainThread]: ` (composer/cli/launcher.py); sample 019",
    ),
    LinePrefix(
        "lightning rank",
        re.compile(r"\[rank: (?P<rank>[0-9]{1,7})\] "),
        RankKind.GLOBAL,
        "Lightning's `[rank: N] ` (lightning_fabric/utilities/rank_zero.py)",
    ),
    LinePrefix(
        "rank colon",
        re.compile(r"[Rr]ank (?P<rank>[0-9]{1,7}): "),
        RankKind.GLOBAL,
        "`rank N: ` printed by training scripts and wrappers",
    ),
    LinePrefix(
        "srun label",
        re.compile(r"[ \t]{0,8}(?P<rank>[0-9]{1,7}): "),
        RankKind.TASK,
        "srun --label `N: ` (tests/data/logs/devcluster_srun_label.log)",
    ),
    LinePrefix(
        "glog",
        re.compile(
            r"[IWEF][0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{1,9}[ \t]{1,8}[0-9]{1,20}"
            r" [^\s\]]{1,512}:[0-9]{1,7}\] ?"
        ),
        None,
        "torch >= 2.4 glog-style `E0325 20:57:27.620000 2606 .../api.py:869] ` (samples 002, 029)",
    ),
    LinePrefix(
        "glog without its head",
        re.compile(r"(?:[\w.\-]{1,128}/){1,32}[\w.\-]{1,128}\.py:[0-9]{1,7}\] "),
        None,
        "sample 005: `torch/distributed/elastic/multiprocessing/api.py:826] failed ...`",
    ),
    LinePrefix(
        "vllm",
        re.compile(
            r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}"
            r" \[?[\w.\-]{1,128}:[0-9]{1,7}\] "
        ),
        None,
        "vLLM's `ERROR 10-11 12:27:29 engine.py:157] ` (vllm/logger.py; sample 024), newer"
        " `DEBUG 02-19 17:35:31 [parallel_state.py:179] ` (stepfun-ai/Step-Video-T2V#29)",
    ),
    LinePrefix(
        "bracketed level",
        re.compile(
            r"\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] \[[\w.\-]{1,128}:[0-9]{1,7}:\w{1,128}\] "
        ),
        None,
        "DeepSpeed's `[ERROR] [launch.py:434:sigkill_handler] ` (deepspeed/utils/logging.py)",
    ),
)
MAX_PREFIXES = 8  # no real line carries more: `192.168.13.81: [rank19]:` is two

# A c10 log line (`[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog ...`, `[PG 0 (default_pg)
# Rank 0]`) names the rank in its process group: the global rank only for the default group.
# Kept in the line's text (its words decide timeout or fault); read only where no prefix named
# a rank. Samples 008, 013, 021 (`[Rank N]`), 012, 014, 037 (`[PG ... Rank N]`).
C10_MESSAGE_RANK = re.compile(
    r"\[[IWEF](?:[0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{1,9})? [\w.\-]{1,128}:[0-9]{1,7}\] "
    r"\[(?:PG (?P<group>[^\]]{0,200}) )?Rank (?P<rank>[0-9]{1,7})\]"
)
DEFAULT_GROUP = re.compile(r"\A(?:ID )?0\b|default_pg")

# Lines between Composer's `----------Begin global rank 1 STDERR----------` and its `End` are
# that rank's (composer/cli/launcher.py `_print_process_exit_status`).
RANK_BLOCK_START = re.compile(
    r"-{4,80}Begin global rank (?P<rank>[0-9]{1,7}) STD(?:OUT|ERR)-{4,80}"
)
RANK_BLOCK_END = re.compile(r"-{4,80}End global rank [0-9]{1,7} STD(?:OUT|ERR)-{4,80}")

# An interactive shell's prompt names the machine the command ran on (`user@host:~/dir$ `,
# `user@host ~ % `, `[user@host dir]$ `): samples 016, 022, 045.
SHELL_PROMPT = re.compile(
    r"(?:\([\w.\-]{1,64}\)[ \t]{1,4})?\[?[a-z_][\w.\-]{0,31}@(?P<host>" + HOST_PATTERN + r")"
    r"(?::|[ \t]{1,8})[~/][^\s$#%\]]{0,1024}\]?[ \t]{0,64}[$#%](?:[ \t]|\Z)"
)
