"""The subprocess seam against real processes: argv only, group kill, errors with context."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from daemon.process import CommandError, CommandOutputTooLarge, CommandTimeout, run


def _alive(pid: int) -> bool:
    """A zombie waiting for a reaper counts as dead: it runs nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_timeout_kills_children_and_grandchildren(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! >> {pids}; (sleep 300 & echo $! >> {pids}; wait) & wait"
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as caught:
        run(["bash", "-c", script], timeout=1.0)
    assert time.monotonic() - started < 10
    assert caught.value.argv == ("bash", "-c", script)
    deadline = time.monotonic() + 5
    recorded = [int(pid) for pid in pids.read_text().split()]
    assert len(recorded) == 2
    while any(_alive(pid) for pid in recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in recorded)


def test_failure_carries_argv_exit_code_and_stderr() -> None:
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"]
    result = run(argv, timeout=10)
    assert (result.returncode, result.stderr, result.ok) == (3, "boom\n", False)
    with pytest.raises(CommandError) as caught:
        run(argv, timeout=10, check=True)
    assert caught.value.argv == tuple(argv)
    assert caught.value.returncode == 3
    assert caught.value.stderr == "boom\n"
    assert "boom" in str(caught.value)


def test_non_utf8_output_is_replaced_not_raised() -> None:
    argv = [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end')"]
    assert run(argv, timeout=10).stdout == "ok \ufffd\ufffd end"


def test_argv_is_never_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"$(touch {marker}); touch {marker}"
    result = run(["printf", "%s", hostile], timeout=10)
    assert result.stdout == hostile
    assert not marker.exists()


def test_missing_program_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="cannot start"):
        run(["/nonexistent/sacct"], timeout=5)


def test_stdin_text_reaches_the_command() -> None:
    assert run(["cat"], timeout=10, input_text="#!/bin/bash\necho hi\n").stdout == (
        "#!/bin/bash\necho hi\n"
    )


def test_a_flood_of_output_is_cut_at_the_cap_and_the_group_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # `yes` would print forever; the writer ignores SIGTERM, so only SIGKILL ends it.
    script = f"trap '' TERM; echo $$ > {pids}; yes 'flood of output'"
    with pytest.raises(CommandOutputTooLarge) as caught:
        run(["bash", "-c", script], timeout=60, max_output_bytes=1_000_000)
    assert caught.value.stdout.startswith("flood of output\n")
    assert len(caught.value.stdout) <= 64 * 1024
    pid = int(pids.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_output_up_to_the_cap_and_a_large_stdin_pass_whole() -> None:
    text = "x" * 3_000_000 + "\n"  # larger than any pipe buffer, both ways
    echo = [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"]
    result = run(echo, input_text=text, max_output_bytes=len(text))
    assert result.ok
    assert result.stdout == text
    with pytest.raises(CommandOutputTooLarge):
        run(echo, input_text=text, max_output_bytes=len(text) - 1)
