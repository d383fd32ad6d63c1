"""Expansion of sbatch's stdout/stderr patterns."""

from __future__ import annotations

import pytest

from daemon.slurm.paths import PathContext, default_stdout_pattern, expand_std_path

JOB = PathContext(job_id=1234, name="train", user="alice", first_node="gpu-02")
TASK = PathContext(
    job_id=1240, name="sweep", user="bob", first_node="gpu-01", array_job_id=1234, array_task_id=6
)


@pytest.mark.parametrize(
    ("pattern", "context", "expected"),
    [
        ("%x-%j.out", JOB, "train-1234.out"),
        ("/logs/%u/%N/%j.log", JOB, "/logs/alice/gpu-02/1234.log"),
        ("%A_%a.out", TASK, "1234_6.out"),
        ("%j.out", TASK, "1240.out"),
        ("%A_%3a.out", TASK, "1234_006.out"),
        ("%8j", JOB, "00001234"),
        ("100%%-%j", JOB, "100%-1234"),
        ("%J-%s-%t-%n", JOB, "1234-batch-0-0"),
        ("%A.out", JOB, "1234.out"),
        ("%a.out", JOB, "4294967294.out"),
        ("%q-%j", JOB, "%q-1234"),
        ("no\\%j\\here", JOB, "no%jhere"),
        ("%5N", JOB, "gpu-02"),
    ],
)
def test_expand(pattern: str, context: PathContext, expected: str) -> None:
    assert expand_std_path(pattern, context) == expected


def test_relative_paths_join_the_work_dir() -> None:
    assert expand_std_path("%x.out", JOB, work_dir="/home/alice/run") == "/home/alice/run/train.out"
    assert expand_std_path("/abs/%x.out", JOB, work_dir="/home/alice") == "/abs/train.out"


def test_hostile_name_is_substituted_as_text_only() -> None:
    hostile = PathContext(job_id=7, name="$(touch /tmp/x)%j\n", user="alice")
    # The name is data: its own `%j` is not expanded again and nothing is evaluated.
    assert expand_std_path("%x.out", hostile) == "$(touch /tmp/x)%j\n.out"


def test_defaults() -> None:
    assert expand_std_path(default_stdout_pattern(is_array=False), JOB) == "slurm-1234.out"
    assert expand_std_path(default_stdout_pattern(is_array=True), TASK) == "slurm-1234_6.out"


@pytest.mark.parametrize(
    ("pattern", "context", "seen"),
    [
        (
            "%a-%J-%s-%n-%t-%N-%3j-%%-%A.out",
            PathContext(job_id=6, name="pt", user="alice", first_node="vm"),
            "4294967294-6-batch-0-0-vm-006-%-6.out",
        ),
        (
            "arr-%A-%a-%j-%4a.out",
            PathContext(
                job_id=7, name="pa", user="alice", first_node="vm", array_job_id=7, array_task_id=3
            ),
            "arr-7-3-7-0003.out",
        ),
    ],
)
def test_matches_what_slurmd_22_05_wrote(pattern: str, context: PathContext, seen: str) -> None:
    """File names slurmd created on the dev cluster (2026-11-22) for these --output patterns.

    `%N` is the batch host's own short hostname: every devcluster node runs in a network
    namespace of the one machine `vm`, so slurmd wrote `vm`, not `gpu-01`.
    """
    assert expand_std_path(pattern, context) == seen
