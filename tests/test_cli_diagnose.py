"""`slurm-medic diagnose`: the installed console script, the JSON contract and the exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main
from daemon.evidence.findings import merge_findings
from daemon.evidence.records import GpuFault, LogFindings, RootCause
from daemon.privilege import ProcessIds
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import SlurmError
from daemon.slurm.records import SlurmJob
from tests.factories import ended_job

DATA = Path(__file__).parent / "data"
SCRIPT = Path(sys.executable).with_name("slurm-medic")
OOM_KEYS = {
    "requested_bytes",
    "total_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_unallocated_bytes",
    "process_in_use_bytes",
    "other_processes",
}


def test_installed_script_prints_the_json_contract() -> None:
    result = subprocess.run(
        [
            str(SCRIPT),
            "diagnose",
            "--log",
            str(DATA / "logs" / "torchrun_multirank_backward_oom.log"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert {
        "kind",
        "onset",
        "confidence",
        "reasons",
        "rank",
        "node",
        "step",
        "phase",
        "oom",
        "root_cause",
        "root_cause_line",
    } <= set(verdict)
    # 336.73 MiB reserved but unallocated covers the 226.00 MiB request: fragmentation
    assert verdict["kind"] == "fragmentation"
    assert verdict["root_cause"] == "cuda_oom"
    assert "CUDA out of memory. Tried to allocate 226.00 MiB" in verdict["root_cause_line"]
    assert (verdict["rank"], verdict["node"], verdict["step"], verdict["phase"]) == (
        3,
        "gpu-02",
        120,
        "backward",
    )
    assert set(verdict["oom"]) >= OOM_KEYS
    assert verdict["oom"]["requested_bytes"] == 226 * 1024**2
    assert verdict["oom"]["reserved_unallocated_bytes"] == 353086996
    assert all(isinstance(reason, str) for reason in verdict["reasons"])


def test_alloc_conf_with_expandable_segments_turns_stranded_bytes_into_a_true_oom() -> None:
    log = str(DATA / "logs" / "torchrun_multirank_backward_oom.log")
    conf = "max_split_size_mb:512,expandable_segments:True"
    result = CliRunner().invoke(main, ["diagnose", "--log", log, "--json", "--alloc-conf", conf])
    assert result.exit_code == 0
    verdict = json.loads(result.output)
    assert (verdict["kind"], verdict["onset"]) == ("true_oom", "mid_run")
    assert any("already had expandable_segments:True" in reason for reason in verdict["reasons"])
    off = CliRunner().invoke(
        main, ["diagnose", "--log", log, "--json", "--alloc-conf", "expandable_segments:False"]
    )
    assert json.loads(off.output)["kind"] == "fragmentation"


def test_json_other_processes_and_nulls() -> None:
    result = CliRunner().invoke(
        main, ["diagnose", "--log", str(DATA / "oom" / "torch_other_processes.txt"), "--json"]
    )
    assert result.exit_code == 0
    verdict = json.loads(result.output)
    assert verdict["kind"] == "fragmentation"  # 163.19 MiB stranded covers the 26.00 MiB asked
    assert verdict["oom"]["other_processes"] == [
        {"pid": 3893521, "bytes": 648019968},
        {"pid": 1493972, "bytes": 1374389535},
    ]
    assert verdict["step"] is None


def test_json_oom_is_null_when_not_oom() -> None:
    result = CliRunner().invoke(
        main, ["diagnose", "--log", str(DATA / "logs" / "nccl_timeout_only.log"), "--json"]
    )
    assert result.exit_code == 0
    verdict = json.loads(result.output)
    assert (verdict["kind"], verdict["root_cause"]) == ("unknown", "nccl_timeout")
    assert any("only a collective timeout is in view" in r for r in verdict["reasons"])
    assert verdict["oom"] is None


def test_human_output_verdict_first_then_reasons_numbers_and_advice() -> None:
    result = CliRunner().invoke(
        main, ["diagnose", "--log", str(DATA / "oom" / "torch21_capacty.txt")]
    )
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].startswith("fragmentation")
    text = result.output
    assert text.index("Why") < text.index("Numbers") < text.index("What to do")
    assert "requested: 3.00 GiB (3221225472 bytes)" in text
    assert "expandable_segments:True" in text
    assert lines[2].startswith("root cause cuda_oom: torch.cuda.OutOfMemoryError: CUDA out of")


def test_several_logs_are_merged() -> None:
    result = CliRunner().invoke(
        main,
        [
            "diagnose",
            "--log",
            str(DATA / "logs" / "nccl_timeout_only.log"),
            "--log",
            str(DATA / "oom" / "torch1x_reserved.txt"),
            "--json",
        ],
    )
    assert result.exit_code == 0
    assert json.loads(result.output)["kind"] == "fragmentation"


def test_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["diagnose"]).exit_code == 2
    assert runner.invoke(main, ["diagnose", "1", "--log", "x"]).exit_code == 2
    assert runner.invoke(main, ["diagnose", "--log", "x", "--step-pattern", "("]).exit_code == 2
    missing = runner.invoke(main, ["diagnose", "--log", str(tmp_path / "absent.log")])
    assert missing.exit_code == 3
    hostile = runner.invoke(main, ["diagnose", "--", "-1;touch /tmp/x"])
    assert hostile.exit_code == 4
    assert "not a Slurm job id" in hostile.output
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = runner.invoke(main, ["diagnose", "--log", str(fifo)])
    assert refused.exit_code == 3
    assert "FIFO" in refused.output


def test_markup_in_untrusted_log_text_is_printed_literally(tmp_path: Path) -> None:
    log = tmp_path / "evil.log"
    log.write_text("ValueError: [bold red]pwned[/] $(rm -rf ~)\n")
    result = CliRunner().invoke(main, ["diagnose", "--log", str(log)])
    assert result.exit_code == 0
    assert "[bold red]pwned[/] $(rm -rf ~)" in result.output


@pytest.mark.cluster
@pytest.mark.usefixtures("devcluster")
def test_diagnose_jobid_on_the_local_cluster() -> None:
    """A real 2-node job whose task 1 dies with a real OOM message, diagnosed by job id."""
    work_dir = Path(f"/tmp/medic-diagnose-test-{uuid.uuid4().hex[:8]}")
    work_dir.mkdir()
    shutil.chown(work_dir, "alice", "alice")
    message = (DATA / "oom" / "torch21_capacty.txt").read_text().strip()
    (work_dir / "oom.txt").write_text(message + "\n")
    script = (
        "#!/bin/bash\n"
        "srun --label bash -c 'echo step 7; if [ $SLURM_PROCID = 1 ]; then"
        " cat oom.txt >&2; exit 1; fi; sleep 2'\n"
    )
    cli = SlurmCli(timeout_s=30, attempts=3, backoff_s=0.5)
    try:
        job_id = cli.submit(
            script,
            as_user="alice",
            work_dir=str(work_dir),
            extra_args=["--nodes=2", "--ntasks=2", "--output=medic-%j.out"],
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                job = cli.job(job_id)
            except SlurmError:
                job = None
            if job is not None and job.state.is_terminal() and job.partition is not None:
                break
            time.sleep(0.5)
        result = subprocess.run(
            [str(SCRIPT), "diagnose", str(job_id), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        verdict = json.loads(result.stdout)
        assert verdict["kind"] == "fragmentation"
        assert verdict["rank"] == 1
        assert verdict["step"] == 7
        assert verdict["node"] in {"gpu-01", "gpu-02", "gpu-03", "gpu-04"}
        assert verdict["oom"]["requested_bytes"] == 3 * 1024**3
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def test_merged_findings_keep_the_root_cause_of_the_most_telling_log() -> None:
    timeout = LogFindings(
        root_cause=RootCause.COLLECTIVE_TIMEOUT,
        root_failure_line="[Rank 0] Watchdog caught collective operation timeout",
        step=120,
    )
    fault = LogFindings(
        root_cause=RootCause.GPU_FAULT,
        gpu_fault=GpuFault("CUDA error: unspecified launch failure", "unspecified launch failure"),
        root_failure_line="CUDA error: unspecified launch failure",
        rank=3,
    )
    merged = merge_findings([timeout, fault])
    assert (merged.root_cause, merged.gpu_fault, merged.rank) == (
        RootCause.GPU_FAULT,
        fault.gpu_fault,
        3,
    )
    assert merged.step == 120  # filled from the other log


def test_a_merged_step_zero_is_kept_with_its_line() -> None:
    # The first step is step 0 (HF's `0/1000` bar): a falsy number, but a step all the same.
    failing = LogFindings(
        root_cause=RootCause.ACCELERATOR_OOM, root_failure_line="torch.OutOfMemoryError: ..."
    )
    progress = LogFindings(step=0, step_line="  0%|          | 0/1000 [00:00<?, ?it/s]")
    merged = merge_findings([failing, progress])
    assert (merged.step, merged.step_line) == (0, progress.step_line)


def test_json_and_text_show_a_log_line_with_del_and_bidi_characters_inertly(
    tmp_path: Path,
) -> None:
    log = tmp_path / "evil.log"
    line = "ValueError: rm\x7f\x7f\x7f-rf \u202egnp.exe"
    log.write_text(line + "\n")
    as_json = CliRunner().invoke(main, ["diagnose", "--log", str(log), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert "\x7f" not in as_json.output
    assert "\u202e" not in as_json.output
    assert "rm\\u007f\\u007f\\u007f-rf \\u202egnp.exe" in as_json.output
    assert json.loads(as_json.output)["root_cause_line"] == line  # the same value, escaped
    text = CliRunner().invoke(main, ["diagnose", "--log", str(log)])
    assert text.exit_code == 0, text.output
    assert "\x7f" not in text.output
    assert "rm\\x7f\\x7f\\x7f-rf \\u202egnp.exe" in text.output


@pytest.fixture
def recording_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The timeouts the JOBID path builds its Slurm client with, for job 77 whose output is
    a real OOM message; no system config and no SLURM_MEDIC_ variable."""
    for name in list(os.environ):
        if name.startswith("SLURM_MEDIC_") or name == "SUDO_UID":
            monkeypatch.delenv(name)
    monkeypatch.setattr("daemon.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    log = tmp_path / "slurm-77.out"
    shutil.copy(DATA / "oom" / "torch21_capacty.txt", log)
    job = ended_job(77, end=datetime(2026, 1, 5, 12, tzinfo=UTC), stdout_path=str(log))
    timeouts: list[float] = []

    class RecordingSlurm:
        def __init__(self, *, timeout_s: float) -> None:
            timeouts.append(timeout_s)

        def job(self, job_id: str) -> SlurmJob:
            assert job_id == "77"
            return job

    monkeypatch.setattr("daemon.commands.context.SlurmCli", RecordingSlurm)
    return timeouts


def test_jobid_takes_the_slurm_timeout_of_the_config_it_is_given(
    tmp_path: Path, recording_slurm: list[float]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text("slurm_timeout_s = 7.5\n")
    result = CliRunner().invoke(main, ["diagnose", "77", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kind"] == "fragmentation"
    assert recording_slurm == [7.5]


def test_jobid_without_config_takes_the_system_config_else_the_default(
    tmp_path: Path, recording_slurm: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert CliRunner().invoke(main, ["diagnose", "77"]).exit_code == 0
    system = tmp_path / "system.toml"
    system.write_text("slurm_timeout_s = 12.0\n")
    monkeypatch.setattr("daemon.config.DEFAULT_CONFIG_PATH", system)
    assert CliRunner().invoke(main, ["diagnose", "77"]).exit_code == 0
    assert recording_slurm == [30.0, 12.0]


def test_a_config_that_cannot_be_used_or_chosen_is_a_usage_error_in_diagnoses_voice(
    tmp_path: Path, recording_slurm: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("slurm_timeout_s = -1\n")
    broken = CliRunner().invoke(main, ["diagnose", "77", "--config", str(bad)])
    assert broken.exit_code == 2
    assert broken.stderr.startswith("slurm-medic diagnose: ")
    assert "slurm_timeout_s" in broken.stderr
    with_log = CliRunner().invoke(main, ["diagnose", "--log", "x.log", "--config", str(bad)])
    assert with_log.exit_code == 2
    assert "--config is read only with JOBID" in with_log.output
    monkeypatch.setenv("SUDO_UID", "1001")
    monkeypatch.setattr(
        "daemon.privilege.ProcessIds.current",
        lambda: ProcessIds(uid=0, euid=0, gid=0, egid=0),
    )
    good = tmp_path / "good.toml"
    good.write_text("slurm_timeout_s = 7.5\n")
    refused = CliRunner().invoke(main, ["diagnose", "77", "--config", str(good)])
    assert refused.exit_code == 2
    assert refused.stderr.startswith("slurm-medic diagnose: ")
    assert "--config" in refused.stderr
    assert recording_slurm == []  # Slurm was never asked
