"""deploy/prometheus: promtool accepts the alert rules and their unit tests pass (each alert
fires on its series and stays quiet on the near misses); a rule file with a mistake is
refused, and a rule whose threshold drifts fails its unit test, so these checks can fail.
promtool is Debian's `prometheus` package (deploy/install-system-packages): missing, it fails."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from daemon.process import CommandResult, run

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = "/usr/bin/promtool"
ALERTS = (
    "SlurmMedicPollStale",
    "SlurmMedicRecordsAwaited",
    "SlurmMedicApprovalWaiting",
    "SlurmMedicDrainsNearBreaker",
    "SlurmMedicNoLeader",
    "SlurmMedicRecordUnreadable",
    "SlurmMedicSlurmCommandErrors",
)


def promtool(*args: str, cwd: Path) -> CommandResult:
    assert Path(PROMTOOL).is_file(), f"{PROMTOOL} is missing: deploy/install-system-packages"
    return run([PROMTOOL, *args], timeout=120, cwd=str(cwd))


def copy_rules(tmp_path: Path) -> Path:
    for name in ("alerts.yml", "alerts_test.yml"):
        shutil.copy(RULES_DIR / name, tmp_path / name)
    return tmp_path


def test_promtool_accepts_the_rules() -> None:
    result = promtool("check", "rules", "alerts.yml", cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_the_rules_unit_tests_pass_and_test_every_alert_both_ways() -> None:
    result = promtool("test", "rules", "alerts_test.yml", cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    rules = (RULES_DIR / "alerts.yml").read_text()
    assert tuple(re.findall(r"^ +- alert: (\w+)$", rules, re.MULTILINE)) == ALERTS
    tests = (RULES_DIR / "alerts_test.yml").read_text()
    for alert in ALERTS:
        quiet = re.search(rf"alertname: {alert}\n +exp_alerts: \[\]\n", tests)
        firing = re.search(rf"alertname: {alert}\n +exp_alerts:\n +- exp_labels:", tests)
        assert quiet, f"{alert} is not tested quiet"
        assert firing, f"{alert} is not tested firing"


def test_a_rule_file_with_a_mistake_is_refused(tmp_path: Path) -> None:
    copy_rules(tmp_path)
    rules = tmp_path / "alerts.yml"
    rules.write_text(rules.read_text().replace("> 12 * 3600", "> > 12 * 3600"))
    result = promtool("check", "rules", "alerts.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "alerts.yml" in result.stdout + result.stderr


def test_a_threshold_that_drifts_fails_the_unit_tests(tmp_path: Path) -> None:
    """Three quarters of the breaker made a half: the near miss (7 of 10 drains) fires."""
    copy_rules(tmp_path)
    rules = tmp_path / "alerts.yml"
    text = rules.read_text()
    assert "ceil(0.75 *" in text
    rules.write_text(text.replace("ceil(0.75 *", "ceil(0.5 *"))
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "SlurmMedicDrainsNearBreaker" in result.stdout + result.stderr
