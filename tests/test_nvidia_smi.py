"""nvidia-smi parsers on real published outputs (tests/data/nvidia-smi) and on edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.evidence.nvidia_smi import (
    MIB,
    ComputeAppRow,
    GpuQueryRow,
    NvidiaSmiParseError,
    normalise_bus_id,
    parse_compute_apps,
    parse_gpu_rows,
    parse_query,
)

DATA = Path(__file__).parent / "data" / "nvidia-smi"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_a100_510_pending_remap_is_read_exactly() -> None:
    (gpu,) = parse_query(read("a100-510-remap-pending.txt"))
    assert gpu.pci_bus_id == "00000000:10:1C.0"
    assert gpu.remapped_rows_correctable == 1
    assert gpu.remapped_rows_uncorrectable == 0
    assert gpu.remap_pending is True
    assert gpu.remap_failure_occurred is False
    assert gpu.ecc_volatile_correctable == 177
    assert gpu.ecc_volatile_uncorrectable == 0
    assert gpu.ecc_aggregate_correctable == 177
    assert gpu.ecc_aggregate_uncorrectable == 0
    assert gpu.retired_pages_single_bit is None  # "N/A" on a GPU that remaps rows
    assert gpu.retired_pages_pending is None


def test_a100_555_sram_parity_and_sec_ded_fields_are_summed() -> None:
    gpus = parse_query(read("a100-555-ecc.txt"))
    assert [gpu.pci_bus_id for gpu in gpus] == ["00000000:12:00.0", "00000000:8A:00.0"]
    for gpu in gpus:
        assert gpu.ecc_volatile_uncorrectable == 0
        assert gpu.ecc_aggregate_uncorrectable == 0
        assert gpu.ecc_volatile_correctable == 0
        assert gpu.remap_pending is None  # -d ECC alone prints no Remapped Rows


def test_v100_470_single_and_double_bit_totals_and_retired_pages() -> None:
    (gpu,) = parse_query(read("v100-470-full-q.txt"))
    assert gpu.pci_bus_id == "00000000:1C:00.0"
    assert gpu.ecc_volatile_correctable == 0
    assert gpu.ecc_volatile_uncorrectable == 0
    assert gpu.ecc_aggregate_correctable == 3
    assert gpu.ecc_aggregate_uncorrectable == 0
    assert gpu.retired_pages_single_bit == 1
    assert gpu.retired_pages_double_bit == 0
    assert gpu.retired_pages_pending is False
    assert gpu.remap_pending is None  # "Remapped Rows : N/A" on a V100
    assert gpu.remapped_rows_correctable is None


def test_v100_580_layout_is_still_read() -> None:
    (gpu,) = parse_query(read("v100-580-ecc-i0.txt"))
    assert gpu.pci_bus_id == "00000000:41:00.0"
    assert (gpu.ecc_volatile_correctable, gpu.ecc_volatile_uncorrectable) == (0, 0)
    assert (gpu.ecc_aggregate_correctable, gpu.ecc_aggregate_uncorrectable) == (0, 0)


def test_not_supported_values_are_none_not_errors() -> None:
    text = (
        "GPU 00000000:01:00.0\n"
        "    Remapped Rows\n"
        "        Correctable Error                 : [Not Supported]\n"
        "        Uncorrectable Error               : N/A\n"
        "        Pending                           : [Not Supported]\n"
        "        Remapping Failure Occurred        : N/A\n"
    )
    (gpu,) = parse_query(text)
    assert gpu.remapped_rows_correctable is None
    assert gpu.remapped_rows_uncorrectable is None
    assert gpu.remap_pending is None
    assert gpu.remap_failure_occurred is None


def test_old_retired_pages_layout_with_retired_count() -> None:
    text = (
        "GPU 0000:04:00.0\n"
        "    Retired Pages\n"
        "        Single Bit ECC\n"
        "            Retired Count                 : 2\n"
        "        Double Bit ECC\n"
        "            Retired Count                 : 1\n"
        "        Pending                           : Yes\n"
    )
    (gpu,) = parse_query(text)
    assert (gpu.retired_pages_single_bit, gpu.retired_pages_double_bit) == (2, 1)
    assert gpu.retired_pages_pending is True


def test_binary_garbage_is_a_clear_error() -> None:
    with pytest.raises(NvidiaSmiParseError, match="line 1 is not nvidia-smi -q output"):
        parse_query("\x89PNG\x00\x01garbage\n")


def test_query_gpu_rows_in_bytes() -> None:
    text = (
        "0, GPU-5a0e3c01-7d2b-4c1e-9f3a-0c6d8e2b4a00, 00000000:07:00.0, 81920 MiB, 0 MiB\n"
        "1, GPU-5a0e3c11-7d2b-4c1e-9f3a-0c6d8e2b4a11, 00000000:0F:00.0, 81920 MiB, [N/A]\n"
    )
    assert parse_gpu_rows(text) == (
        GpuQueryRow(
            0, "GPU-5a0e3c01-7d2b-4c1e-9f3a-0c6d8e2b4a00", "00000000:07:00.0", 81920 * MIB, 0
        ),
        GpuQueryRow(
            1, "GPU-5a0e3c11-7d2b-4c1e-9f3a-0c6d8e2b4a11", "00000000:0F:00.0", 81920 * MIB, None
        ),
    )


def test_compute_apps_zombie_and_comma_in_name() -> None:
    text = (
        "GPU-a, 31337, python3, 30720 MiB\n"
        "GPU-a, 4242, [Not Found], 512 MiB\n"
        "GPU-b, 77, /opt/x,y/train, [N/A]\n"
    )
    assert parse_compute_apps(text) == (
        ComputeAppRow("GPU-a", 31337, "python3", 30720 * MIB),
        ComputeAppRow("GPU-a", 4242, None, 512 * MIB),
        ComputeAppRow("GPU-b", 77, "/opt/x, y/train", None),
    )


def test_compute_apps_empty_output_means_no_process() -> None:
    assert parse_compute_apps("") == ()


def test_memory_without_unit_is_rejected() -> None:
    with pytest.raises(NvidiaSmiParseError, match="not a MiB amount"):
        parse_gpu_rows("0, GPU-a, 0000:01:00.0, 80 GB, 0 MiB\n")


def test_bus_ids_of_both_widths_compare_equal() -> None:
    assert normalise_bus_id("00000000:3B:00.0") == normalise_bus_id("0000:3b:00.0")


@given(st.text(max_size=400))
def test_query_parser_either_reads_or_raises_its_own_error(text: str) -> None:
    try:
        gpus = parse_query(text)
    except NvidiaSmiParseError:
        return
    assert all(gpu.pci_bus_id for gpu in gpus)


@given(st.text(max_size=300))
def test_csv_parsers_never_raise_anything_else(text: str) -> None:
    for parse in (parse_gpu_rows, parse_compute_apps):
        try:
            rows = parse(text)
        except NvidiaSmiParseError:
            continue
        assert isinstance(rows, tuple)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**6),
            st.integers(1, 2**22),
            st.text(
                alphabet=st.characters(blacklist_characters=",\n\r", blacklist_categories=["Cs"]),
                min_size=1,
                max_size=20,
            ).filter(lambda s: s.strip() == s and s.strip()),
        ),
        max_size=8,
    )
)
def test_compute_apps_round_trip(rows: list[tuple[int, int, str]]) -> None:
    text = "".join(f"GPU-x, {pid}, {name}, {mib} MiB\n" for pid, mib, name in rows)
    parsed = parse_compute_apps(text)
    expected = [
        (pid, None if name.lower() in {"n/a", "[n/a]", "none", "[not found]"} else name, mib * MIB)
        for pid, mib, name in rows
    ]
    got = [(row.pid, row.process_name, row.used_bytes) for row in parsed]
    assert len(got) == len(expected)
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[2] for g in got] == [e[2] for e in expected]
