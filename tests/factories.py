"""Records the tests build again and again: one ended Slurm job, as accounting would report it."""

from __future__ import annotations

from datetime import datetime, timedelta

from daemon.slurm.records import JobState, SlurmJob


def ended_job(
    job_id: int,
    *,
    user: str = "alice",
    uid: int | None = 1001,
    name: str = "train",
    state: JobState = JobState.FAILED,
    end: datetime,
    nodes: tuple[str, ...] = ("gpu-01",),
    work_dir: str | None = None,
    stdout_path: str | None = None,
) -> SlurmJob:
    """A job of `user` that ran an hour on `nodes` and ended at `end`."""
    home = work_dir or f"/home/{user}/run"
    return SlurmJob(
        job_id=job_id,
        name=name,
        user=user,
        uid=uid,
        group=user,
        account="research",
        partition="gpu",
        state=state,
        state_raw=state.value,
        exit_code=1 if state is JobState.FAILED else 0,
        exit_signal=None,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=nodes,
        batch_host=nodes[0] if nodes else None,
        submit_time=end - timedelta(hours=2),
        start_time=end - timedelta(hours=1),
        end_time=end,
        stdout_path=stdout_path or f"{home}/slurm-%j.out",
        stderr_path=None,
        work_dir=home,
        comment=None,
    )
