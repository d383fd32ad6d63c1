"""Every real OOM sample parsed, with each number asserted to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.evidence.oom import parse_oom
from daemon.evidence.oom_family import host_ram_is_certain
from daemon.evidence.records import OomFamily, OtherProcess

DATA = Path(__file__).parent / "data" / "oom"
GIB = 1024**3
MIB = 1024**2

# file -> (requested, total, free, allocated, reserved, reserved_unallocated, process_in_use)
TORCH_NUMBERS = {
    "torch10_cached.txt": (
        13107200,
        11725260718,
        9964324127,
        8986296,
        13893632,
        4907336,
        None,
    ),
    "torch10_cached_kib.txt": (
        1048576,
        11993696174,
        589824,
        11703785882,
        11736249795,
        32463913,
        None,
    ),
    "torch1x_reserved.txt": (
        3081639035,
        15848429322,
        20709376,
        9416715796,
        14721000407,
        5304284611,
        None,
    ),
    "torch1x_max_split_zero_free.txt": (
        67108864,
        4294967296,
        0,
        3597035110,
        3661459620,
        64424510,
        None,
    ),
    "torch113_cuda_oome.txt": (
        1492501135,
        6442450944,
        501219328,
        4337916969,
        4456028570,
        118111601,
        None,
    ),
    "torch21_capacty.txt": (
        3221225472,
        25393994138,
        1782411428,
        12981538652,
        18178449080,
        5196910428,
        22344567357,
    ),
    "torch21_container_pid.txt": (
        520093696,
        15837691904,
        246478275,
        15096810045,
        15443280527,
        346470482,
        None,
    ),
    "torch21_free_exceeds_request.txt": (2147483648, 4294967296, 3006477107, 0, 0, 0, None),
    "torch22_expandable.txt": (
        23068672,
        25393994138,
        11597251,
        24588687770,
        24793023775,
        204336005,
        25340307046,
    ),
    "torch24_torch_oome.txt": (
        24459838751,
        33790655201,
        13668733420,
        9749575762,
        19789061816,
        10039486054,
        20111184364,
    ),
    "torch_private_pool.txt": (
        572522496,
        16932908564,
        539167293,
        14742475244,
        15515128955,
        772653711,
        None,
    ),
    "torch_other_processes.txt": (
        27262976,
        12519829668,
        10286531,
        9985798963,
        10156916080,
        171117117,
        10458245366,
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_NUMBERS))
def test_torch_messages_parse_to_exact_bytes(name: str) -> None:
    report = parse_oom((DATA / name).read_text())
    assert report is not None
    assert report.family is OomFamily.TORCH_ALLOCATOR
    got = (
        report.requested_bytes,
        report.total_bytes,
        report.free_bytes,
        report.allocated_bytes,
        report.reserved_bytes,
        report.reserved_unallocated_bytes,
        report.process_in_use_bytes,
    )
    assert got == TORCH_NUMBERS[name]


def test_printed_figure_is_exact_to_what_was_printed() -> None:
    report = parse_oom((DATA / "torch1x_reserved.txt").read_text())
    assert report is not None
    # 2.87 GiB = 3081639034.88 bytes: the figure was rounded by PyTorch; we keep what it printed.
    assert report.requested_bytes == round(287 * GIB / 100)
    assert report.free_bytes == int(19.75 * MIB)


def test_one_zero_cached_means_unallocated_part_in_old_messages() -> None:
    report = parse_oom((DATA / "torch10_cached_kib.txt").read_text())
    assert report is not None
    # 1.0-1.3 printed "cached" as the unallocated part: 30.96 MiB next to 10.90 GiB allocated.
    assert report.reserved_unallocated_bytes == round(3096 * MIB / 100)


def test_other_processes_and_pool_and_conf_spellings() -> None:
    others = parse_oom((DATA / "torch_other_processes.txt").read_text())
    assert others is not None
    assert others.other_processes == (
        OtherProcess(pid=3893521, bytes=618 * MIB),
        OtherProcess(pid=1493972, bytes=round(128 * GIB / 100)),
    )
    assert others.alloc_conf_var == "PYTORCH_CUDA_ALLOC_CONF"
    assert others.alloc_conf == "expandable_segments:True"
    pool = parse_oom((DATA / "torch_private_pool.txt").read_text())
    assert pool is not None
    assert pool.private_pool_bytes == 46 * MIB
    hint = parse_oom((DATA / "torch113_cuda_oome.txt").read_text())
    assert hint is not None
    assert hint.suggests_max_split
    assert hint.alloc_conf is None
    new_spelling = parse_oom(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a"
        " total capacity of 79.19 GiB of which 1.10 GiB is free. If reserved but unallocated"
        " memory is large try setting PYTORCH_ALLOC_CONF=expandable_segments:True to avoid"
        " fragmentation."
    )
    assert new_spelling is not None
    assert new_spelling.alloc_conf_var == "PYTORCH_ALLOC_CONF"
    assert new_spelling.total_bytes == round(7919 * GIB / 100)


def test_gpu_index_in_both_wordings() -> None:
    old = parse_oom((DATA / "torch1x_reserved.txt").read_text())
    new = parse_oom((DATA / "torch21_capacty.txt").read_text())
    assert old is not None
    assert new is not None
    assert (old.gpu_index, new.gpu_index) == (0, 0)


@pytest.mark.parametrize(
    ("name", "family", "requested"),
    [
        ("cuda_runtime.txt", OomFamily.CUDA_RUNTIME, None),
        ("cuda_runtime_accelerator_error.txt", OomFamily.CUDA_RUNTIME, None),
        ("cublas.txt", OomFamily.CUBLAS, None),
        ("cudnn.txt", OomFamily.CUDNN, None),
        ("nccl.txt", OomFamily.NCCL, 6291456),
        ("xla.txt", OomFamily.XLA, 4770354232),
        ("xla_allocating.txt", OomFamily.XLA, 20029400304),
        ("torch_more_than_1eb.txt", OomFamily.TORCH_ALLOCATOR, None),
    ],
)
def test_other_families(name: str, family: OomFamily, requested: int | None) -> None:
    report = parse_oom((DATA / name).read_text())
    assert report is not None
    assert report.family is family
    assert report.requested_bytes == requested


@pytest.mark.parametrize(
    ("name", "certain"),
    [
        ("slurmstepd_oom_kill.txt", True),
        ("slurmstepd_oom_kill_old.txt", True),
        ("kernel_oom_killer.txt", True),
        ("dataloader_killed.txt", True),
        ("torchrun_sigkill.txt", False),
        ("bare_killed.txt", False),
    ],
)
def test_host_ram_deaths(name: str, certain: bool) -> None:
    text = (DATA / name).read_text()
    report = parse_oom(text)
    assert report is not None
    assert report.family is OomFamily.HOST_RAM
    assert host_ram_is_certain(text) is certain


def test_truncated_message_keeps_the_numbers_it_still_has() -> None:
    text = (DATA / "torch21_capacty.txt").read_text()
    cut = text[: text.index("12.09") + 4]  # "...Of the allocated memory 12.0"
    report = parse_oom(cut)
    assert report is not None
    assert report.requested_bytes == 3 * GIB
    assert report.free_bytes == round(166 * GIB / 100)
    assert report.allocated_bytes is None
    assert report.reserved_unallocated_bytes is None


def test_text_without_oom_is_none() -> None:
    assert parse_oom("ValueError: bad shape (3, 4)") is None
    assert parse_oom("") is None


def test_rocm_and_jax_wordings() -> None:
    hip = parse_oom((DATA / "rocm_hip.txt").read_text())
    assert hip is not None
    assert (hip.requested_bytes, hip.total_bytes, hip.free_bytes) == (
        4831838208,
        17158394348,
        1503238554,
    )
    assert hip.alloc_conf_var == "PYTORCH_HIP_ALLOC_CONF"
    big = parse_oom((DATA / "rocm_hip_free_exceeds.txt").read_text())
    assert big is not None
    assert (big.gpu_index, big.free_bytes) == (7, 218495723766)
    xla = parse_oom((DATA / "xla_failed_to_allocate.txt").read_text())
    assert xla is not None
    assert xla.family is OomFamily.XLA
    assert xla.requested_bytes == 184549376


@pytest.mark.parametrize(
    ("text", "family"),
    [
        (
            "RuntimeError: cuda runtime error (2) : out of memory at"
            " /pytorch/aten/src/THC/generic/THCStorage.cu:58",
            OomFamily.CUDA_RUNTIME,
        ),
        (
            "slurmstepd: error: Job 1234 exceeded memory limit (8388608 > 8192000), being killed",
            OomFamily.HOST_RAM,
        ),
        ("slurmstepd: error: Exceeded step memory limit at some point.", OomFamily.HOST_RAM),
        ("Memory cgroup out of memory: Killed process 4321 (python)", OomFamily.HOST_RAM),
    ],
)
def test_older_runtime_and_slurm_wordings(text: str, family: OomFamily) -> None:
    report = parse_oom(text)
    assert report is not None
    assert report.family is family
