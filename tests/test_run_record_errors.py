"""`slurm-medic run` on a record it cannot reach says so in one line, never a traceback."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from daemon.cli import main


def test_an_unreachable_record_is_one_line_without_the_password(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    # Port 1 on loopback: nothing listens, the connection is refused at once.
    config.write_text('[store]\nurl = "postgresql+psycopg://medic:s3cret@127.0.0.1:1/medic"\n')
    result = CliRunner().invoke(
        main, ["run", "--once", "--config", str(config)], env={"SLURM_MEDIC_CONFIG": None}
    )
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    assert "s3cret" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("slurm-medic run:")]
    assert len(lines) == 1
    assert "127.0.0.1:1/medic cannot be used" in lines[0]
