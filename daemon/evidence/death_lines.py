"""What launchers print when a worker dies: torchrun's, DeepSpeed's, Open MPI's, hydra's and
srun's death lines, the details printed after them, and the signals they name.

Data, like the line prefixes in `launchers`: each entry is a pattern with named groups and
where its format comes from (the launcher's source, or a real sample under
`tests/data/real/logs/`), so a new launcher's format is one more entry. Apart from the prefixes
because those are stripped from every line, while these are matched only on the lines a
prefix-free reading kept. Every pattern runs in linear time on any line; groups: `rank`,
`local_rank`, `host`, `pid`, `exit` (an exit code as printed, negative for a signal in
Python's convention), `signal` (a signal number), `signame` (a signal's name or `strsignal`
text); where two alternatives of one pattern name the same thing, the second spelling ends in
a digit (`signame2`). The scanner range-checks every number it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from daemon.evidence.launchers import HOST_PATTERN, IP_PATTERN
from daemon.evidence.records import RootCause


@dataclass(frozen=True)
class DeathLine:
    """A launcher's line saying that a worker died, and how (its exit code or signal)."""

    name: str
    literal: str | None  # a fixed string each such line holds, tested first (None: always try)
    pattern: re.Pattern[str]
    source: str
    details: tuple[re.Pattern[str], ...] = ()  # more groups elsewhere on the same line


@dataclass(frozen=True)
class DeathDetail:
    """A line that completes the death a launcher reported just before (`  Exit code:    1`)."""

    name: str  # the `DeathLine.name` it completes
    literal: str
    pattern: re.Pattern[str]
    source: str


# Open MPI's launchers by the names they print (`%s` in their help texts), and a PID as printed
# or as a poster masked it (`with PID xxxxxx`): the rank and the node are what count.
_OPEN_MPI_TOOL = r"(?:mpirun|mpiexec|orterun|prterun|prun)"
_OPEN_MPI_PID = r"(?:(?P<pid>[0-9]{1,10})|[^\s0-9]\S{0,31})"

_LOCAL_RANK_ARGUMENT = re.compile(r"--local_rank=(?P<local_rank>[0-9]{1,7})\b")

DEATH_LINES: tuple[DeathLine, ...] = (
    DeathLine(
        "torchrun agent",
        "failed (exitcode:",
        re.compile(
            r"failed \(exitcode: (?P<exit>-?[0-9]{1,10})\) local_rank: (?P<local_rank>[0-9]{1,7})"
            r" \(pid: (?P<pid>[0-9]{1,10})\)"
        ),
        "torch/distributed/elastic/multiprocessing/api.py (`SubprocessContext._poll`: 'failed"
        " (exitcode: %s) local_rank: %s (pid: %s) of binary: %s'), in every era: 1.x `ERROR:torch"
        ".distributed...:failed` (003, 031), 2.1 `[...] torch.distributed...: [ERROR] failed`"
        " (045), 2.4+ glog (002, 029), head lost (005), glued to a tqdm bar (004)",
    ),
    DeathLine(
        "torchelastic no error file",
        "FAILED (exitcode",
        re.compile(
            r"Child process (?P<pid>[0-9]{1,10}) \(local_rank (?P<local_rank>[0-9]{1,7})\)"
            r" FAILED \(exitcode (?P<exit>-?[0-9]{1,10})\)"
        ),
        "torch 1.9's `CHILD PROCESS FAILED WITH NO ERROR_FILE` banner"
        " (torch/distributed/elastic/multiprocessing/errors/__init__.py"
        " `_no_error_file_warning_msg`: 'Child process %s (local_rank %s) FAILED (exitcode %s)');"
        " samples 073, 074",
    ),
    DeathLine(
        "srun task launch",
        "srun: error: Task launch for",
        re.compile(
            r"srun: error: Task launch for [0-9]{1,12}\.[0-9a-z+]{1,16} failed on node"
            r" (?P<host>" + HOST_PATTERN + r"):"
        ),
        "Slurm's srun (src/srun/step_launch.c: 'Task launch for %ps failed on node %s: %s'):"
        " the step never started there; sample 072",
    ),
    DeathLine(
        "deepspeed launcher",
        "exits with return code",
        re.compile(r"exits with return code = (?P<exit>-?[0-9]{1,10})"),
        "deepspeed/launcher/launch.py `sigkill_handler`: '{cmd} exits with return code = {code}',"
        " the worker's command naming `--local_rank=N`; samples 009, 010",
        (_LOCAL_RANK_ARGUMENT,),
    ),
    DeathLine(
        "torch.distributed.launch",
        "CalledProcessError",
        re.compile(
            r"returned non-zero exit status (?P<exit>-?[0-9]{1,10})"
            r"|died with <Signals\.(?P<signame>SIG[A-Z0-9]{1,10}): (?P<signal>[0-9]{1,3})>"
        ),
        "torch/distributed/launch.py before 1.9 raises subprocess.CalledProcessError for the"
        " worker's command (`--local_rank=N`); CPython's CalledProcessError.__str__; sample 020",
        (_LOCAL_RANK_ARGUMENT,),
    ),
    DeathLine(
        "composer",
        "crashed with exit code",
        re.compile(r"\bRank (?P<rank>[0-9]{1,7}) crashed with exit code (?P<exit>-?[0-9]{1,10})"),
        "composer/cli/launcher.py `_monitor_processes`; sample 019",
    ),
    DeathLine(
        "composer exit",
        "exited with code",
        re.compile(
            r"\bGlobal rank (?P<rank>[0-9]{1,7}) \(PID (?P<pid>[0-9]{1,10})\) exited with code"
            r" (?P<exit>-?[0-9]{1,10})"
        ),
        "composer/cli/launcher.py `_print_process_exit_status`",
    ),
    DeathLine(
        "mpirun signal",
        " noticed that process rank ",
        re.compile(
            _OPEN_MPI_TOOL
            + r" noticed that process rank (?P<rank>[0-9]{1,7}) with PID "
            + _OPEN_MPI_PID
            + r" on node (?P<host>"
            + HOST_PATTERN
            + r")(?: exited on signal (?P<signal>[0-9]{1,3}))?"
        ),
        "Open MPI's and PRRTE's help text ([prun:proc-aborted-strsignal] in prrte's"
        " help-prun.txt, orterun's before it): '%s noticed that process rank %lu with PID %lu on"
        " node %s exited on signal %d (%s).' (its signal may wrap to the next line:"
        " adda-team/adda#151; a pasted PID may be masked: held-out sample 022)",
    ),
    DeathLine(
        "mpirun exit",
        "has exited due to process rank",
        re.compile(
            _OPEN_MPI_TOOL
            + r" has exited due to process rank (?P<rank>[0-9]{1,7}) with PID "
            + _OPEN_MPI_PID
            + r" on(?: node (?P<host>"
            + HOST_PATTERN
            + r"))?"
        ),
        "Open MPI's / PRRTE's [prun:proc-ordered-abort] and [prun:proc-exit-no-sync]: '%s has"
        " exited due to process rank %lu with PID %lu on' / 'node %s calling \"abort\".' (or"
        " 'exiting improperly'): the node's name is on the help text's next line",
    ),
    DeathLine(
        "torch.multiprocessing.spawn",
        "rocess ",
        re.compile(
            r"\bprocess (?P<local_rank>[0-9]{1,7}) terminated with"
            r" (?:signal (?P<signame>SIG[A-Z0-9]{1,10})|exit code (?P<exit>-?[0-9]{1,10}))"
            r"|-- Process (?P<local_rank2>[0-9]{1,7}) terminated with the following error"
        ),
        "torch/multiprocessing/spawn.py `ProcessExitedException` ('process %d terminated with"
        " signal %s', HRNet/HigherHRNet-Human-Pose-Estimation#47) and `ProcessRaisedException`"
        " ('-- Process %d terminated with the following error:', the worker's traceback follows)",
    ),
    DeathLine(
        "lightning",
        "Child process with PID",
        re.compile(
            r"Child process with PID (?P<pid>[0-9]{1,10}) terminated with code"
            r" (?P<exit>-?[0-9]{1,10})"
        ),
        "Lightning's subprocess launcher `_ChildProcessObserver` ('[rank: 1] Child process with"
        " PID 2977 terminated with code 4. Forcefully terminating ...': the prefix is the child's"
        " rank), lightning/fabric/strategies/launchers/subprocess_script.py",
    ),
    DeathLine(
        "torchelastic event",
        "torchelastic.worker.status.FAILED",
        re.compile(r"torchelastic\.worker\.status\.FAILED"),
        'torch 1.9-1.10\'s elastic events on stdout: {"name": "torchelastic.worker.status.FAILED",'
        ' ... "global_rank": 1, ... "hostname": "ip-..."} (pytorch/pytorch#64990)',
        (
            re.compile(r'"global_rank": (?P<rank>[0-9]{1,7})\b'),
            re.compile(r'"hostname": "(?P<host>' + HOST_PATTERN + r')"'),
        ),
    ),
    DeathLine(
        "mpirun",
        "Process name:",
        re.compile(
            r"^\s{0,8}Process name:\s{1,8}\["
            r"(?:\[[0-9]{1,10},[0-9]{1,10}\]|[\w.\-]{1,256}@[0-9]{1,10}),(?P<rank>[0-9]{1,7})\]"
        ),
        "Open MPI's 'mpirun detected that one or more processes exited with non-zero status ...'"
        " block (`Process name: [[jobid,1],rank]`, then `Exit code:`); samples 018, 025",
    ),
    DeathLine(
        "hydra",
        "RUNNING AT",
        re.compile(r"^=\s{1,8}PID (?P<pid>[0-9]{1,10}) RUNNING AT (?P<host>" + HOST_PATTERN + r")"),
        "MPICH/Intel MPI hydra's 'BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES' block",
    ),
    DeathLine(
        "pdsh",
        "ssh exited with exit code",
        re.compile(
            r"pdsh@[\w.\-]{1,253}: (?P<host>" + HOST_PATTERN + r"): ssh exited with exit code"
            r" (?P<exit>-?[0-9]{1,10})"
        ),
        "pdsh's `pdsh@uan: nid000008: ssh exited with exit code 127` (pdsh's ssh module:"
        " '%p: %s: ssh exited with exit code %d'), as DeepSpeed's multi-node runner prints it",
    ),
    DeathLine(
        "python fatal error",
        "Fatal Python error:",
        re.compile(
            r"Fatal Python error: (?P<signame>Segmentation fault|Aborted|Bus error"
            r"|Floating point exception|Illegal instruction)"
        ),
        "CPython's faulthandler (Modules/faulthandler.c); sample 013",
    ),
    DeathLine(
        "caught signal",
        "Caught signal",
        re.compile(r"Caught signal (?P<signal>[0-9]{1,3}) \("),
        "UCX's `[host:pid:thread:tid] Caught signal 7 (Bus error: ...)` (ucs/debug/debug.c);"
        " sample 023",
    ),
    DeathLine(
        "shell",
        None,
        re.compile(
            r"^(?P<signame>Killed)(?:\s{0,64}\Z|(?=[a-z]))"
            r"|^(?P<signame2>Segmentation fault|Bus error|Aborted|Terminated)(?: \(core dumped\))?"
            r"\s{0,64}\Z"
            r"|: line [0-9]{1,9}:\s{1,8}[0-9]{1,10}\s{1,8}(?P<signame3>Killed|Segmentation fault"
            r"|Bus error|Aborted|Terminated)\b"
        ),
        "the shell's report of a child killed by a signal: a line of its own (016), one whose"
        " `\\r` progress line showed through it (026: `Killedg in train batch`), or a batch"
        " script's `script: line 12: 4242 Killed  python train.py`",
    ),
    DeathLine(
        "ray worker died",
        "A worker died or was killed",
        re.compile(r"A worker died or was killed while executing a task"),
        "Ray's raylet report of a dead worker (`Worker IP address: ..., Worker PID: ...`);"
        " sample 041",
        (
            re.compile(r"Worker IP address: (?P<host>" + IP_PATTERN + r")\b"),
            re.compile(r"Worker PID: (?P<pid>[0-9]{1,10})\b"),
        ),
    ),
)

DEATH_DETAILS: tuple[DeathDetail, ...] = (
    DeathDetail(
        "mpirun signal",
        "signal",
        re.compile(r"^\s{0,8}(?:exited on )?signal (?P<signal>[0-9]{1,3}) \("),
        "Open MPI's `exited on` / `signal 6 (Aborted).` wrapped to the next line",
    ),
    DeathDetail(
        "mpirun exit",
        "node ",
        re.compile(
            r"^\s{0,8}node (?P<host>" + HOST_PATTERN + r") (?:calling \"abort\"|exiting improperly)"
        ),
        "the second line of Open MPI's 'has exited due to process rank ... on' help text",
    ),
    DeathDetail(
        "mpirun",
        "Exit code:",
        re.compile(r"^\s{0,8}Exit code:\s{1,16}(?P<exit>-?[0-9]{1,10})\s{0,16}\Z"),
        "Open MPI's block, the line after `Process name:`; samples 018, 025",
    ),
    DeathDetail(
        "hydra",
        "EXIT CODE:",
        re.compile(r"^=\s{1,8}EXIT CODE: (?P<exit>-?[0-9]{1,10})"),
        "hydra's block, the line after `RUNNING AT`",
    ),
    DeathDetail(
        "hydra",
        "EXIT STRING:",
        re.compile(r"EXIT STRING: [^(]{0,64}\(signal (?P<signal>[0-9]{1,3})\)"),
        "hydra's `YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)`",
    ),
)
DETAIL_WITHIN_LINES = 6  # Open MPI's and hydra's blocks put the detail within a few lines


@dataclass(frozen=True)
class WrappedHead:
    """The head of a launcher's death line that a terminal or a paste hard-wrapped: the line's
    end, which its `DeathLine` pattern matches, comes alone on a later line."""

    name: str  # the `DeathLine.name` it opens
    literal: str
    pattern: re.Pattern[str]  # matched on the line as printed, its prefixes included
    source: str


WRAPPED_HEADS: tuple[WrappedHead, ...] = (
    WrappedHead(
        "deepspeed launcher",
        ":sigkill_handler] [",
        re.compile(r"\[launch\.py:[0-9]{1,7}:sigkill_handler\] \["),
        "deepspeed/launcher/launch.py logs `{cmd} exits with return code = {code}` with the"
        " worker's argv list as `cmd`: a long argv wraps, its `--local_rank=N` on the head and"
        " `] exits with return code = -9` on the last piece (held-out sample 069)",
    ),
)
WRAPPED_WITHIN_LINES = 8  # a wrapped line's pieces follow each other
WRAPPED_CHARS = 16 * 1024  # of the pieces, at most this much is joined

# srun's per-task line: `srun: error: node107: task 0: Out Of Memory`, `tasks 2,4-5,7:
# Terminated`, `task 3: Exited with exit code 1` (samples 015, 051). The task list stays text:
# the scanner reads it as ranges, never expanded.
SRUN_ERROR = re.compile(
    r"srun: error: (?P<host>[\w.\-]{1,253}): tasks? (?P<tasks>[0-9,\-]{1,16384})"
    r": (?P<what>.{1,512})"
)
SRUN_EXIT = re.compile(r"[Ee]xit(?:ed with exit)? code:?\s{0,8}(?P<exit>-?[0-9]{1,10})")

# `strsignal` texts (srun, the shell, faulthandler) and Python's `Signals` names, Linux numbers.
SIGNALS: dict[str, int] = {
    "Hangup": 1,
    "Interrupt": 2,
    "Quit": 3,
    "Illegal instruction": 4,
    "Aborted": 6,
    "Bus error": 7,
    "Floating point exception": 8,
    "Killed": 9,
    "Segmentation fault": 11,
    "Terminated": 15,
    "SIGHUP": 1,
    "SIGINT": 2,
    "SIGQUIT": 3,
    "SIGILL": 4,
    "SIGABRT": 6,
    "SIGBUS": 7,
    "SIGFPE": 8,
    "SIGKILL": 9,
    "SIGSEGV": 11,
    "SIGTERM": 15,
}
SIGKILL = 9
# Signals another process sends to stop a worker: the launcher's or Slurm's SIGTERM after
# another rank failed, a user's Ctrl-C. A worker dying of one is the cascade, not a failure.
STOP_SIGNALS = frozenset({1, 2, 15})
MAX_SIGNAL = 64
SHELL_SIGNAL_BASE = 128  # a shell's exit status 128+N: killed by signal N


def signal_of(exit_code: int | None, signal: int | None) -> int | None:
    """The signal a worker died of: given, or read from its exit code (Python's -N, a shell's
    128+N)."""
    if signal is not None:
        return signal if 0 < signal <= MAX_SIGNAL else None
    if exit_code is None:
        return None
    if -MAX_SIGNAL <= exit_code < 0:
        return -exit_code
    if SHELL_SIGNAL_BASE < exit_code <= SHELL_SIGNAL_BASE + MAX_SIGNAL:
        return exit_code - SHELL_SIGNAL_BASE
    return None


def death_cause(exit_code: int | None, signal: int | None) -> RootCause | None:
    """What a death says about the failure: SIGKILL with no traceback is the host's OOM killer
    (`exitcode: -9`); a stop signal or exit 0 is no failure of that worker; anything else is
    another error (`-11`, `-7`, exit 1)."""
    if signal == SIGKILL:
        return RootCause.HOST_RAM
    if signal in STOP_SIGNALS or (signal is None and exit_code == 0):
        return None
    return RootCause.OTHER_ERROR
