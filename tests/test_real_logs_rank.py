"""Who failed first, where, and of what: the scanner on real logs of every launcher's format.

The samples under `tests/data/real/logs/` are compared with their labels (each label quotes the
line that decides it); the excerpts below them are further real posts, verbatim, with their
source, that show a format on more than one sample. The small logs at the end pin one rule each.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemon.evidence.joblog import scan_log
from daemon.evidence.launchers import PREFIXES, RankKind
from daemon.evidence.log_events import MAX_NOTES
from daemon.evidence.log_lines import strip_line
from daemon.evidence.records import MAX_RANK, LogFindings, OomFamily, RootCause
from daemon.evidence.xid import load_catalog
from daemon.slurm.records import MAX_EXIT_CODE
from tests.corpus import LOGS_DIR, LogLabel, load_log_labels

LABELS = {label.file[:3]: label for label in load_log_labels()}


def _real(number: str) -> tuple[LogFindings, LogLabel]:
    label = LABELS[number]
    return scan_log(LOGS_DIR / label.file), label


def _scan(text: str) -> LogFindings:
    return scan_log(io.BytesIO(text.encode()))


def _cause(found: LogFindings) -> str:
    return "none" if found.root_cause is None else found.root_cause.value


# --- the real corpus, format by format ---------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [
        "011",  # `2024-11-20 14:37:16 [rank3]: ...`: a timestamp before torch's prefix
        "030",  # `[gpu187:2]:`: host and rank in one bracket
        "036",  # pdsh's `192.168.13.81: [rank19]:`
        "041",  # Ray's `(raylet)` report naming `Worker IP address: ...`
        "028",  # a wrapper's `stderr: ` before torchrun's agent line
        "054",  # `[rank6]:` OOM, then rank 1's traceback interleaved
        "029",  # rank 2's OOM shown, the agent names another local rank
    ],
)
def test_rank_and_host_are_read_through_any_prefix(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, found.node, _cause(found)) == (label.rank, label.host, label.root_cause)


@pytest.mark.parametrize(
    "number",
    [
        "002",  # torch 2.4+ glog: `E0325 20:57:27.620000 2606 .../api.py:869] failed ...`
        "003",  # torch 1.x `ERROR:torch.distributed...:failed`, SIGTERMs printed before it
        "004",  # glued to the end of a tqdm bar
        "005",  # its glog head lost: `torch/.../api.py:826] failed ...`
        "031",  # eight SIGTERMs, then the SIGKILLed local rank
        "045",  # torch 2.1 `[2023-...] torch.distributed...: [ERROR] failed ...`
        "032",  # an unprefixed OOM: the rank comes from the agent line after it
        "040",  # the same, under an agent that restarts the worker group
    ],
)
def test_torchrun_agent_line_names_the_failed_local_rank_in_every_era(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, _cause(found)) == (label.rank, label.root_cause)
    assert any("local rank" in note for note in found.notes)


@pytest.mark.parametrize("number", ["009", "010"])
def test_deepspeed_launcher_return_code_and_local_rank_argument(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, _cause(found)) == (label.rank, label.root_cause)
    assert found.exit_code is not None
    assert found.killed_by_signal == -found.exit_code


@pytest.mark.parametrize(
    "number",
    [
        "001",  # 1.10+ table, `traceback : Signal 9 (SIGKILL) received by PID`
        "027",  # `Failures:` entry printed before the Root Cause entry
        "033",  # two agents' tables: the Root Cause with the earlier `time` wins
        "043",  # 1.9 `Root Cause:` with the error file's JSON under `msg:`
        "044",  # 1.10 table with `error_file:` and the traceback inside it
    ],
)
def test_root_cause_table_in_every_format(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, found.node, _cause(found)) == (label.rank, label.host, label.root_cause)


def test_the_error_files_message_under_msg_explains_the_table_entry() -> None:
    found, label = _real("043")  # `"message": "RuntimeError: rasing error since --throw ..."`
    assert found.error_type == "RuntimeError"
    assert found.root_failure_line is not None
    assert found.root_failure_line in label.root_cause_line


@pytest.mark.parametrize(
    "number",
    [
        "015",  # srun `task 0: Out Of Memory` after slurmstepd's oom-kill line
        "018",  # Open MPI `Process name: [[29973,1],0]` / `Exit code:    1`
        "019",  # Composer `Rank 1 crashed with exit code 1.`
        "023",  # UCX `[host:pid :0:tid] Caught signal 7 (Bus error ...)`
        "025",  # Open MPI's older wording, rank 8
    ],
)
def test_launchers_report_the_first_death(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, found.node, _cause(found)) == (label.rank, label.host, label.root_cause)


@pytest.mark.parametrize(
    "number", ["012", "013", "014", "021", "022", "035", "036", "037", "038", "039"]
)
def test_gpu_faults_in_the_job_log_are_the_root_cause_with_their_line(number: str) -> None:
    found, label = _real(number)
    assert (found.rank, found.node, _cause(found)) == (label.rank, label.host, label.root_cause)
    assert found.gpu_fault is not None
    assert found.gpu_fault.line == found.root_failure_line
    assert found.gpu_fault.words


@pytest.mark.parametrize("number", ["037", "038"])
def test_a_process_group_rank_is_not_the_global_rank(number: str) -> None:
    # `[rank29]:[E1002 ...] [PG ID 5 PG GUID 83(TENSOR_MODEL_PARALLEL_GROUP) Rank 1] ...`
    found, label = _real(number)
    assert found.rank == label.rank
    assert found.rank != 1


@pytest.mark.parametrize("number", ["016", "020", "026"])
def test_host_ram_kills_without_a_traceback(number: str) -> None:
    # a bare `Killed`, a DataLoader worker killed, `Killedg in train batch: ...`
    found, label = _real(number)
    assert (found.rank, found.node, _cause(found)) == (label.rank, label.host, label.root_cause)
    assert found.oom is not None
    assert found.oom.family is OomFamily.HOST_RAM


@pytest.mark.parametrize("number", ["006", "007", "008", "053"])
def test_collective_timeouts_with_no_earlier_failure(number: str) -> None:
    found, label = _real(number)
    assert found.root_cause is RootCause.COLLECTIVE_TIMEOUT
    assert (found.rank, found.node) == (label.rank, label.host) == (None, None)
    assert found.cascade_ranks  # the ranks that timed out are the cascade


@pytest.mark.parametrize("number", ["034", "051"])
def test_a_cancel_from_outside_is_no_failure_of_any_rank(number: str) -> None:
    # Determined's agent receiving SIGTERM; Slurm's `CANCELLED ... DUE TO TIME LIMIT`
    found, label = _real(number)
    assert label.root_cause == "none"
    assert (found.root_cause, found.rank, found.node) == (None, None, None)
    assert (found.exit_code, found.killed_by_signal, found.root_failure_line) == (None, None, None)


# --- further real posts, verbatim --------------------------------------------------------------

# https://github.com/JingyunLiang/RVRT/issues/31 (top and bottom cut): an unprefixed OOM, then
# the agent's one-line report of the local rank that failed.
RVRT = """\
  File "/share3/home/lufuzhen/anaconda3/envs/rvrt/lib/python3.8/site-packages/torch/nn/modules/linear.py", line 114, in forward
    return F.linear(input, self.weight, self.bias)
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 23.64 GiB total capacity; 4.58 GiB already allocated; 18.50 MiB free; 4.68 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF
WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 2498673 closing signal SIGTERM
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 1 (pid: 2498674) of binary: /share3/home/lufuzhen/anaconda3/envs/rvrt/bin/python
"""  # noqa: E501

# https://github.com/vllm-project/speculators/issues/1115 (cut inside the Root Cause entry):
# `Failures:` first, then the Root Cause entry whose exit code is below the excerpt.
SPECULATORS = """\
Failures:
[1]:
  time      : 2026-09-07_13:02:58
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 14692)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[2]:
  time      : 2026-09-07_13:03:29
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 14689)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14689
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-09-07_13:02:58
  host      : localhost
  rank      : 1 (local_rank: 1)
"""

# https://github.com/QwenLM/Qwen3-Coder/issues/174 (a later post): the table's entry without its
# `[0]:` line, every line behind a timestamp.
QWEN_TABLE = """\
2024-11-20 14:38:16   time      : 2024-11-20_14:37:28
2024-11-20 14:38:16   host      : 584-5971-20241120143511-master-0
2024-11-20 14:38:16   rank      : 3 (local_rank: 3)
2024-11-20 14:38:16   exitcode  : 1 (pid: 96)
2024-11-20 14:38:16   error_file: <N/A>
2024-11-20 14:38:16   traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""

# https://github.com/HRNet/HigherHRNet-Human-Pose-Estimation/issues/47: torch.multiprocessing
# .spawn's report of a worker SIGKILLed (its index is the local rank).
SPAWN = """\
  File "/home/hiperdyne/.local/lib/python3.6/site-packages/torch/multiprocessing/spawn.py", line 107, in join
    (error_index, name)
Exception: process 1 terminated with signal SIGKILL
"""  # noqa: E501

# https://github.com/horovod/horovod/issues/469 and https://github.com/adda-team/adda/issues/151
# (the signal wrapped to the next line).
MPIRUN = """\
mpirun noticed that process rank 7 with PID 0 on node HOSTNAME exited on signal 9 (Killed).
"""
MPIEXEC_WRAPPED = (
    "mpiexec noticed that process rank 0 with PID 10313 on node proton exited on \n"
    "signal 6 (Aborted).\n"
    "--------------------------------------------------------------------------\n"
)

# https://github.com/facebookresearch/deit/issues/102: one task failed, Slurm cancelled the step
# and killed the others.
DEIT = """\
srun: error: learnfair0824: task 5: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=43575862.0
slurmstepd: error: *** STEP 43575862.0 ON learnfair0824 CANCELLED AT 2021-07-14T08:00:36 ***
srun: error: learnfair0824: tasks 3,7: Killed
srun: error: learnfair0833: task 8: Killed
srun: Force Terminated StepId=43575862.0
"""

# https://github.com/pytorch/pytorch/issues/64990: torch 1.9's elastic events on stdout.
ELASTIC_EVENT = (
    '{"name": "torchelastic.worker.status.FAILED", "source": "WORKER", "timestamp": 0,'
    ' "metadata": {"run_id": "1234", "global_rank": 1, "group_rank": 1, "worker_id": "28454",'
    ' "role": "default", "hostname": "ip-172-30-2-79", "state": "FAILED", "total_run_time": 43,'
    ' "rdzv_backend": "c10d", "raw_error": "{\\"message\\": \\"<NONE>\\"}", "metadata":'
    ' "{\\"group_world_size\\": 2}", "agent_restarts": 3}}\n'
)

# Lightning's child process observer (found in a public post quoting a Lightning run): the
# `[rank: 1]` prefix is the dead child's rank.
LIGHTNING = (
    "INFO: [rank: 1] Child process with PID 9487 terminated with code -9. Forcefully"
    " terminating all other processes to avoid zombies 🧟\n"
)


@pytest.mark.parametrize(
    ("text", "rank", "node", "cause"),
    [
        (RVRT, 1, None, RootCause.ACCELERATOR_OOM),
        (SPECULATORS, 1, "localhost", RootCause.OTHER_ERROR),
        (QWEN_TABLE, 3, "584-5971-20241120143511-master-0", RootCause.OTHER_ERROR),
        (SPAWN, 1, None, RootCause.HOST_RAM),
        (MPIRUN, 7, "HOSTNAME", RootCause.HOST_RAM),
        (MPIEXEC_WRAPPED, 0, "proton", RootCause.OTHER_ERROR),
        (DEIT, 5, "learnfair0824", RootCause.OTHER_ERROR),
        (ELASTIC_EVENT, 1, "ip-172-30-2-79", RootCause.OTHER_ERROR),
        (LIGHTNING, 1, None, RootCause.HOST_RAM),
    ],
    ids=[
        "agent",
        "table-cut",
        "table-headless",
        "spawn",
        "mpirun",
        "mpiexec-wrapped",
        "srun",
        "event",
        "lightning",
    ],
)
def test_further_real_posts(text: str, rank: int, node: str | None, cause: RootCause) -> None:
    found = _scan(text)
    assert (found.rank, found.node, found.root_cause) == (rank, node, cause)


def test_a_wrapped_signal_completes_the_death_reported_before_it() -> None:
    assert _scan(MPIEXEC_WRAPPED).killed_by_signal == 6


# --- one rule each ---------------------------------------------------------------------------

HOOK = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
    " capacity of 79.19 GiB of which 1.00 GiB is free."
)


@pytest.mark.parametrize(
    ("line", "rank", "kind", "node", "body"),
    [
        ("2024-11-20 14:37:16 [rank3]: x", 3, RankKind.GLOBAL, None, "x"),
        (
            "[80746] [rank0]:[E321 02:07:08.4 ProcessGroupNCCL.cpp:607] x",
            0,
            RankKind.GLOBAL,
            None,
            "[E321 02:07:08.4 ProcessGroupNCCL.cpp:607] x",
        ),
        ("[default3]:x", 3, RankKind.LOCAL, None, "x"),
        ("3: [default1]: x", 1, RankKind.LOCAL, None, "x"),
        ("5: x", 5, RankKind.TASK, None, "x"),
        ("1: [rank3]: x", 3, RankKind.GLOBAL, None, "x"),
        ("[gpu187:2]:x", 2, RankKind.GLOBAL, "gpu187", "x"),
        ("192.168.13.81: [rank19]:x", 19, RankKind.GLOBAL, "192.168.13.81", "x"),
        (
            'worker-1:   File "a.py", line 1, in f',
            None,
            None,
            "worker-1",
            '  File "a.py", line 1, in f',
        ),
        ("(RayTrainWorker pid=42, ip=10.0.0.7) [rank1]: x", 1, RankKind.GLOBAL, "10.0.0.7", "x"),
        ("(pid=42) x", None, None, None, "x"),
        ("[1,4]<stderr>:x", 4, RankKind.GLOBAL, None, "x"),
        (
            "2023-04-24 16:03:12,379: rank0[1003409][MainThread]: DEBUG: x",
            0,
            RankKind.GLOBAL,
            None,
            "x",
        ),
        ("[rank: 2] x", 2, RankKind.GLOBAL, None, "x"),
        ("stderr: ERROR:x", None, None, None, "ERROR:x"),
        ("[2024-02-27T21:35:32.106313Z] fa88a9df || WARNING: x", None, None, None, "x"),
        (
            "E0325 20:57:27.620000 2606 site-packages/torch/api.py:869] failed",
            None,
            None,
            None,
            "failed",
        ),
        ("ERROR 10-11 12:27:29 engine.py:157] x", None, None, None, "x"),
        ("DEBUG 02-19 17:35:31 [parallel_state.py:179] x", None, None, None, "x"),
        (
            "[2025-05-27 04:36:06 DP1 TP4] Scheduler hit an exception: x",
            None,
            None,
            None,
            "Scheduler hit an exception: x",
        ),
        ("INFO: [rank: 1] x", 1, RankKind.GLOBAL, None, "x"),
        (
            "[2023-04-14 13:11:27,885] [ERROR] [launch.py:434:sigkill_handler] x",
            None,
            None,
            None,
            "x",
        ),
        ("torch.cuda.OutOfMemoryError: x", None, None, None, "torch.cuda.OutOfMemoryError: x"),
        ("RuntimeError: x", None, None, None, "RuntimeError: x"),
    ],
)
def test_prefixes_are_stripped_keeping_the_rank_and_host_they_name(
    line: str, rank: int | None, kind: RankKind | None, node: str | None, body: str
) -> None:
    assert strip_line(line) == (rank, kind, node, body)


def test_every_prefix_of_the_vocabulary_cites_its_source() -> None:
    assert all(prefix.source and prefix.pattern.pattern for prefix in PREFIXES)
    assert len({prefix.name for prefix in PREFIXES}) == len(PREFIXES)


def test_a_failure_printed_again_with_its_rank_names_the_rank() -> None:
    found = _scan(
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
        "[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with exception:"
        " CUDA error: uncorrectable ECC error encountered\n"
    )
    assert (found.rank, found.root_cause) == (1, RootCause.GPU_FAULT)
    assert found.root_failure_line is not None
    assert found.root_failure_line.startswith("RuntimeError")


def test_an_xid_printed_in_the_log_takes_the_catalogs_words() -> None:
    found = _scan(
        "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, pid=4242, GPU has fallen off the bus.\n"
    )
    assert found.root_cause is RootCause.GPU_FAULT
    assert found.gpu_fault is not None
    assert found.gpu_fault.xid == 79
    assert load_catalog().entry(79).meaning in found.gpu_fault.words


def test_a_launcher_death_is_explained_by_the_failure_printed_after_it() -> None:
    # srun's line reaches the log before the rank's buffered output (the local cluster's order)
    found = _scan(
        f"srun: error: gpu-03: tasks 8-11,12-15: Exited with exit code 1\n[rank13]: {HOOK}\n"
    )
    assert (found.rank, found.node, found.root_cause) == (13, "gpu-03", RootCause.ACCELERATOR_OOM)
    assert found.oom is not None


def test_an_abort_of_another_process_keeps_the_rank_unknown_but_the_fault_explains_it() -> None:
    found = _scan(
        "(RayWorkerVllm pid=7046) Fatal Python error: Aborted\n"
        "[E ProcessGroupNCCL.cpp:916] [Rank 0] NCCL watchdog thread terminated with exception:"
        " CUDA error: an illegal memory access was encountered\n"
    )
    assert (found.rank, found.root_cause) == (None, RootCause.GPU_FAULT)


def test_a_rank_that_timed_out_and_then_aborted_died_of_the_cascade() -> None:
    found = _scan(
        "srun: error: gpu-04: task 3: Killed\n"
        "[rank2]:[E1122 04:50:19.4 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective"
        " operation timeout: WorkNCCL(SeqNum=3) ran for 29000 milliseconds before timing out.\n"
        "srun: error: gpu-03: task 2: Aborted\n"
    )
    assert (found.rank, found.node, found.root_cause) == (3, "gpu-04", RootCause.HOST_RAM)
    assert 2 in found.cascade_ranks


def test_tasks_killed_after_a_step_cancel_are_no_failure() -> None:
    found = _scan(
        "slurmstepd: error: *** STEP 77.0 ON gpu-01 CANCELLED AT 2024-03-01T10:00:00 ***\n"
        "srun: error: gpu-01: tasks 0-3: Killed\n"
    )
    assert (found.root_cause, found.rank, found.killed_by_signal) == (None, None, None)


def test_nothing_after_a_time_limit_is_a_rank_failure() -> None:
    found = _scan(
        "slurmstepd: error: *** JOB 77 ON gpu-01 CANCELLED AT 2024-03-01T10:00:00 DUE TO TIME"
        " LIMIT ***\n"
        "[rank0]: RuntimeError: interrupted\n"
    )
    assert (found.root_cause, found.rank) == (None, None)
    assert any("stopped from outside" in note for note in found.notes)


def test_hydra_block_completes_its_death_with_the_signal() -> None:
    found = _scan(
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
        "=   PID 433969 RUNNING AT c1u12n01\n"
        "=   EXIT CODE: 9\n"
        "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
    )
    assert (found.node, found.root_cause, found.killed_by_signal) == (
        "c1u12n01",
        RootCause.HOST_RAM,
        9,
    )


def test_composer_stderr_block_gives_its_lines_the_rank() -> None:
    found = _scan(
        "ERROR:composer.cli.launcher:Rank 1 crashed with exit code 1.\n"
        "----------Begin global rank 1 STDERR----------\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in forward\n'
        "    x()\n"
        f"{HOOK}\n"
        "----------End global rank 1 STDERR----------\n"
    )
    assert (found.rank, found.root_cause, found.exit_code) == (1, RootCause.ACCELERATOR_OOM, 1)
    assert found.frames == ("forward",)


def test_rays_memory_monitor_kill_is_host_ram_not_a_device_oom() -> None:
    found = _scan(
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
    )
    assert found.root_cause is RootCause.HOST_RAM


def test_an_assert_naming_a_process_group_file_is_no_cascade() -> None:
    found = _scan(
        '[rank1]: RuntimeError: ncclComm != nullptr INTERNAL ASSERT FAILED at "/pytorch/torch/'
        'csrc/distributed/c10d/ProcessGroupNCCL.cpp":4043, please report a bug to PyTorch.\n'
        "[rank: 1] Child process with PID 2053468 terminated with code 1. Forcefully terminating"
        " all other processes to avoid zombies 🧟\n"
        "Killed\n"
    )
    assert (found.rank, found.root_cause) == (1, RootCause.OTHER_ERROR)


def test_an_oom_wrapped_over_prefixed_lines_is_read_with_its_own_ranks_lines() -> None:
    # the message of tests/data/real/oom/075 (wrapped), each line behind rank 3's prefix, with
    # another rank's line between: only rank 3's lines continue it
    found = _scan(
        "[rank3]: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.\n"
        "[rank3]: GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.\n"
        "[rank1]: {'loss': 1.25, 'epoch': 0.4}\n"
        "[rank3]: Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,\n"
        "[rank3]: this process has 15.32 GiB memory in use. Of the allocated memory\n"
        "[rank3]: 14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved\n"
        "[rank3]: by PyTorch but unallocated. If reserved but unallocated memory is large\n"
    )
    assert (found.rank, found.root_cause) == (3, RootCause.ACCELERATOR_OOM)
    assert found.oom is not None
    assert found.oom.allocated_bytes == 15161234555  # 14.12 GiB
    assert found.oom.reserved_unallocated_bytes == 430346076  # 410.41 MiB


def test_pdsh_reports_the_node_whose_remote_command_failed() -> None:
    # pdsh's ssh module: '%p: %s: ssh exited with exit code %d' (DeepSpeed's multi-node runner)
    found = _scan(
        "nid000008: bash: ./bwcheck.sh: No such file or directory\n"
        "pdsh@uan: nid000008: ssh exited with exit code 127\n"
    )
    assert (found.node, found.root_cause, found.exit_code) == (
        "nid000008",
        RootCause.OTHER_ERROR,
        127,
    )


def test_communicator_errors_alone_are_another_error_not_a_timeout() -> None:
    found, label = _real("042")
    assert found.root_cause is RootCause.OTHER_ERROR
    assert label.root_cause.value == found.root_cause.value


# --- bounds --------------------------------------------------------------------------------

FORMATS = st.sampled_from(
    [
        "2024-11-20 14:37:16 ",
        "[80746] ",
        "[gpu187:2]:",
        "192.168.13.81: ",
        "worker-1: ",
        "(RayTrainWorker pid=42, ip=10.0.0.7) ",
        "(raylet) ",
        "[1,4]<stderr>:",
        "rank0[1003409][MainThread]: ",
        "[rank: 2] ",
        "stderr: ",
        "fa88a9df || ",
        "E0325 20:57:27.620000 2606 a/api.py:869] ",
        "[E ProcessGroupNCCL.cpp:737] [Rank ",
        "[PG ID 5 PG GUID 83(X) Rank ",
        "failed (exitcode: ",
        ") local_rank: ",
        " (pid: ",
        "exits with return code = ",
        "'--local_rank=",
        "Rank 1 crashed with exit code ",
        "  Process name: [[29973,1],",
        "  Exit code:    ",
        "mpirun noticed that process rank ",
        " with PID 1 on node gpu-01 exited on signal ",
        "=   PID 1 RUNNING AT gpu-01",
        "=   EXIT CODE: ",
        "Fatal Python error: Aborted",
        "Caught signal ",
        "Killed",
        "process 3 terminated with signal SIGKILL",
        "----------Begin global rank 9 STDERR----------",
        "srun: error: gpu-01: tasks 0-3: ",
        "Exited with exit code ",
        "CANCELLED AT 2024-03-01T10:00:00 DUE TO TIME LIMIT",
        "Watchdog caught collective operation timeout",
        "CUDA error: an illegal memory access was encountered",
        "NVRM: Xid (PCI:0000:02:00): ",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2024-01-01_00:00:00",
        "  rank      : ",
        "  exitcode  : ",
        '  msg:\n    "message": "RuntimeError: x",',
        "user@gpu-07:~/run$ ",
        HOOK,
        "\n",
    ]
)
NUMBERS = st.one_of(
    st.integers(-(10**12), 10**12).map(str), st.just("9" * 40), st.just("4294967296")
)
LINES = st.lists(st.one_of(FORMATS, NUMBERS, st.text(max_size=6)), max_size=40).map("".join)


@given(LINES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example("[rank99999999]: Fatal Python error: Aborted\nsrun: error: a: task 9999999: Killed")
@example("failed (exitcode: -99999999999) local_rank: 99999999 (pid: 99999999999)")
@example("  Process name: [[1,1],9999999]\n  Exit code:    " + "9" * 30)
def test_any_mix_of_launcher_formats_gives_findings_in_range(text: str) -> None:
    found = _scan(text)
    assert found.rank is None or 0 <= found.rank <= MAX_RANK
    assert all(0 <= rank <= MAX_RANK for rank in found.cascade_ranks)
    assert found.exit_code is None or abs(found.exit_code) <= MAX_EXIT_CODE
    assert found.killed_by_signal is None or 0 < found.killed_by_signal <= 64
    assert len(found.notes) <= MAX_NOTES + 4
    if found.root_cause is None:  # no failure: it claims nobody failed, anywhere
        assert (found.rank, found.node, found.root_failure_line) == (None, None, None)
    if found.gpu_fault is not None:
        assert found.root_cause is RootCause.GPU_FAULT
