"""`slurm-medic doctor` judged on real outputs (the local cluster's `scontrol show config`,
sacct's words with slurmdbd stopped, the node probe's documents), and its local gathering on
real sockets, files and an HTTP server; the whole command on the real cluster is
test_doctor_cluster.py."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main
from daemon.config import load_settings
from daemon.doctor.facts import (
    AccountingError,
    AccountingFact,
    CommandAnswer,
    ConfigFact,
    EpilogFact,
    Facts,
    HookFact,
    NoAnswer,
    ProbeFact,
    ProbeOutcome,
    RecordFact,
    SlurmFacts,
    SocketState,
    WebFact,
)
from daemon.doctor.gather import HOOK_DEFAULT, Bounded, hook_fact, program_file, web_fact
from daemon.doctor.judge import (
    Item,
    Report,
    Status,
    judge,
    judge_accounting,
    judge_config,
    judge_epilog,
    judge_hook,
    judge_probe,
    judge_record,
    judge_slurm,
    judge_web,
    probe_candidate,
)
from daemon.evidence.prober import ProbeSettings
from daemon.hook import HookListener
from daemon.slurm.controller import parse_release, parse_show_config, release_number
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import NodeBaseState, SlurmNode

DATA = Path(__file__).resolve().parent / "data"
SHOW_CONFIG = (DATA / "slurm" / "dbv0.0.38" / "scontrol-show-config.txt").read_text()
SLURMDBD_STOPPED = (DATA / "slurm" / "dbv0.0.38" / "sacct-slurmdbd-stopped.stderr").read_text()
HEALTHY_DOCUMENT = (DATA / "node-probe" / "gpu-01-healthy.json").read_text()
GARBAGE_DOCUMENT = (DATA / "node-probe" / "garbage.json").read_text()
VERSION = "slurm-wlm 22.05.8\n"
CONFIG = Path("/etc/slurm-medic/config.toml")
HOOK_LINE = "EpilogSlurmctld=/etc/slurm/slurm-medic-epilog"


def answer(stdout: str = "", *, returncode: int | None = 0, stderr: str = "") -> CommandAnswer:
    return CommandAnswer(("scontrol",), returncode, stdout, stderr)


def slurm(show_config: str = SHOW_CONFIG, version: str = VERSION) -> SlurmFacts:
    return SlurmFacts(answer(version), answer(show_config), 30.0)


def with_line(key: str, value: str, text: str = SHOW_CONFIG) -> str:
    """The real capture with one `Key = Value` line changed, as another site would print it."""
    lines = [
        f"{key:<23} = {value}" if line.split(" ", 1)[0] == key else line
        for line in text.splitlines()
    ]
    assert lines != text.splitlines(), key
    return "\n".join(lines) + "\n"


def probe_settings(tmp_path: Path) -> ProbeSettings:
    key, known = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("not read by the judge")
    known.write_text("")
    return ProbeSettings(key_path=key, known_hosts_path=known)


# ------------------------------------------------------------------------------ Slurm's words


def test_the_real_show_config_is_read_with_what_doctor_needs() -> None:
    config = parse_show_config(SHOW_CONFIG)
    assert config.release == "22.05.8"
    assert config.controller_host == "vm(10.77.0.1)"
    assert config.get("ClusterName") == "medic-dev"
    assert config.accounting_address == "localhost:6819"
    assert config.get("AccountingStorageType") == "accounting_storage/slurmdbd"
    assert config.store_flags == ("job_comment",)
    assert config.epilog_slurmctld == ()  # `(null)` on the local cluster
    assert config.slurm_user == ("slurm", 64030)
    # slurm.conf's own section wins over a later section's key of the same name.
    assert parse_show_config(SHOW_CONFIG + "\nClusterName = other\n").get("ClusterName") == (
        "medic-dev"
    )


def test_a_list_of_epilogs_is_every_program() -> None:
    text = with_line("EpilogSlurmctld", "/etc/slurm/site-epilog, /etc/slurm/slurm-medic-epilog")
    assert parse_show_config(text).epilog_slurmctld == (
        "/etc/slurm/site-epilog",
        "/etc/slurm/slurm-medic-epilog",
    )


@pytest.mark.parametrize("text", ["", "Slurmctld(primary) at vm is UP\n", "x" * (5 << 20)])
def test_text_that_is_no_config_is_a_parse_error(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_show_config(text)


def test_releases_of_debian_and_schedmd_builds() -> None:
    assert parse_release(VERSION) == "22.05.8"
    assert parse_release("slurm 24.11.5\n") == "24.11.5"
    assert parse_release("scontrol: command not found") is None
    assert release_number("22.05.8") == (22, 5)
    assert release_number("23.11.4") > (22, 5)  # type: ignore[operator]


# ------------------------------------------------------------------------------ slurm item


def test_slurm_on_the_real_cluster_names_the_release_and_the_controller() -> None:
    item = judge_slurm(slurm())
    assert item == Item(
        "slurm",
        Status.OK,
        "scontrol 22.05.8; slurmctld 22.05.8 on vm(10.77.0.1) answers, cluster medic-dev",
    )


def test_no_controller_is_a_failure_that_says_to_start_it() -> None:
    down = "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)\n"
    item = judge_slurm(SlurmFacts(answer(VERSION), answer(returncode=1, stderr=down), 30.0))
    assert item.status is Status.FAIL
    assert item.fact.endswith("Unable to contact slurm controller (connect failure)")
    assert item.action is not None
    assert "systemctl start slurmctld" in item.action


def test_munge_trouble_says_munge() -> None:
    said = "scontrol: error: Munge encode failed: Failed to access munge socket\n"
    item = judge_slurm(SlurmFacts(answer(VERSION), answer(returncode=1, stderr=said), 30.0))
    assert item.status is Status.FAIL
    assert item.action is not None
    assert "munge -n | unmunge" in item.action


def test_no_slurm_commands_at_all() -> None:
    missing = CommandAnswer(("scontrol", "--version"), None, failure="cannot start command")
    item = judge_slurm(SlurmFacts(missing, missing, 30.0))
    assert item.status is Status.FAIL
    assert item.fact == "scontrol does not run here: cannot start command"


def test_an_old_release_or_a_client_of_another_release_is_a_warning() -> None:
    old = judge_slurm(slurm(with_line("SLURM_VERSION", "21.08.8"), "slurm 21.08.8\n"))
    assert old.status is Status.WARN
    assert "older than 22.05" in old.fact
    mixed = judge_slurm(slurm(version="slurm 24.11.5\n"))
    assert mixed.status is Status.WARN
    assert mixed.action == "install the client commands of Slurm 22.05.8 on this host"


# ------------------------------------------------------------------------------ accounting


def test_accounting_that_answers_and_keeps_comments() -> None:
    item = judge_accounting(AccountingFact(300.0, jobs=3), slurm())
    assert item.status is Status.OK
    assert item.fact == (
        "sacct reads slurmdbd at localhost:6819: 3 job(s) ended in the last 5 min;"
        " job comments are kept"
    )


def test_a_stopped_slurmdbd_is_named_with_what_to_do() -> None:
    last = SLURMDBD_STOPPED.strip().splitlines()[-1]
    item = judge_accounting(
        AccountingFact(300.0, error=AccountingError.UNAVAILABLE, said=last), slurm()
    )
    assert item.status is Status.FAIL
    assert item.fact.startswith("slurmdbd at localhost:6819 refuses connections: slurmdbd is not")
    assert item.action is not None
    assert "systemctl start slurmdbd" in item.action


def test_a_slurmdbd_that_hangs_is_not_said_to_be_stopped() -> None:
    fact = AccountingFact(300.0, error=AccountingError.UNAVAILABLE, said="no answer within 30s")
    item = judge_accounting(fact, slurm())
    assert item.status is Status.FAIL
    assert item.fact == "slurmdbd at localhost:6819 does not answer sacct: no answer within 30s"


def test_accounting_without_slurmdbd_or_without_comments_fails_with_the_line_to_set() -> None:
    none = slurm(with_line("AccountingStorageType", "accounting_storage/none"))
    item = judge_accounting(AccountingFact(300.0, jobs=0), none)
    assert (item.status, item.fact.split(":")[0]) == (
        Status.FAIL,
        "AccountingStorageType is accounting_storage/none",
    )
    bare = slurm(with_line("AccountingStoreFlags", "(null)"))
    item = judge_accounting(AccountingFact(300.0, jobs=0), bare)
    assert item.status is Status.FAIL
    assert "AccountingStoreFlags is not set" in item.fact
    assert item.action == (
        "add `AccountingStoreFlags=job_comment` to slurm.conf, then restart slurmctld"
    )


def test_accounting_with_no_controller_config_cannot_vouch_for_comments() -> None:
    item = judge_accounting(AccountingFact(300.0, jobs=1), NoAnswer("scontrol (slurmctld)", 65))
    assert item.status is Status.WARN
    assert item.fact.startswith("sacct reads slurmdbd: 1 job(s)")


# ------------------------------------------------------------------------------ probe


def test_no_probe_section_is_a_warning_that_says_what_it_costs() -> None:
    item = judge_probe(ProbeFact(None), CONFIG)
    assert item.status is Status.WARN
    assert item.fact.startswith("not configured: without [probe] no node is ever probed")
    assert item.action is not None
    assert "set [probe] key_path" in item.action


def test_a_real_healthy_document_is_a_working_probe(tmp_path: Path) -> None:
    fact = ProbeFact(
        probe_settings(tmp_path),
        "gpu-01",
        "--node",
        ProbeOutcome.ANSWERED,
        document=HEALTHY_DOCUMENT,
        probed_at=datetime.now(UTC),
        duration_s=0.42,
    )
    item = judge_probe(fact, CONFIG)
    assert item == Item(
        "probe",
        Status.OK,
        "gpu-01 (--node) answered the probe over SSH as medic in 0.4 s: healthy",
    )


def test_a_document_whose_tools_cannot_be_read_is_a_warning(tmp_path: Path) -> None:
    fact = ProbeFact(
        probe_settings(tmp_path),
        "gpu-02",
        "--node",
        ProbeOutcome.ANSWERED,
        document=GARBAGE_DOCUMENT,
    )
    item = judge_probe(fact, CONFIG)
    assert item.status is Status.WARN
    assert "its state could not be read" in item.fact
    assert item.action == (
        f"`slurm-medic probe gpu-02 --key {tmp_path / 'key'} --known-hosts"
        f" {tmp_path / 'known_hosts'} --user medic --port 22` shows each tool's error"
    )


def test_a_forced_command_that_is_not_the_probe_fails(tmp_path: Path) -> None:
    fact = ProbeFact(
        probe_settings(tmp_path),
        "gpu-01",
        "--node",
        ProbeOutcome.ANSWERED,
        document='{"placeholder": true}\n',
    )
    item = judge_probe(fact, CONFIG)
    assert item.status is Status.FAIL
    assert "did not answer with the probe's document" in item.fact


@pytest.mark.parametrize(
    ("outcome", "in_fact", "in_action"),
    [
        (ProbeOutcome.KEY_REFUSED, "medic@gpu-01:22 refuses the key", "authorized_keys"),
        (ProbeOutcome.UNKNOWN_HOST, "has no host key for gpu-01", "fingerprint"),
        (ProbeOutcome.HOST_KEY_CHANGED, "offers another host key", "ssh-keygen -R gpu-01"),
        (ProbeOutcome.UNREACHABLE, "no SSH session to medic@gpu-01:22", "sshd running"),
        (ProbeOutcome.TIMED_OUT, "ran past command_timeout_s (45 s)", "command_timeout_s"),
        (ProbeOutcome.PROBE_EXIT, "the probe program failed", "run medic-node-probe"),
        (ProbeOutcome.KEY_UNSAFE, "the probe key", "chmod 600"),
        (ProbeOutcome.NO_NODE, "no node to probe", "--node NODE"),
    ],
)
def test_each_refusal_is_a_failure_with_its_own_remedy(
    tmp_path: Path, outcome: ProbeOutcome, in_fact: str, in_action: str
) -> None:
    detail = "the probe key /x has mode 0644" if outcome is ProbeOutcome.KEY_UNSAFE else "said"
    fact = ProbeFact(probe_settings(tmp_path), "gpu-01", "--node", outcome, detail=detail)
    item = judge_probe(fact, CONFIG)
    assert item.status is Status.FAIL
    assert in_fact in item.fact
    assert item.action is not None
    assert in_action in item.action


def node(name: str, state: NodeBaseState, *flags: str) -> SlurmNode:
    return SlurmNode(name, None, state, frozenset(flags), None, None, None)


def test_the_probe_goes_to_the_first_node_that_is_up() -> None:
    nodes = [
        node("gpu-01", NodeBaseState.DOWN),
        node("gpu-02", NodeBaseState.IDLE, "NOT_RESPONDING"),
        node("gpu-03", NodeBaseState.ALLOCATED, "DRAIN"),
        node("gpu-04", NodeBaseState.IDLE),
    ]
    assert probe_candidate(nodes) == ("gpu-03", "the first node slurmctld lists that is up")
    assert probe_candidate(nodes[:2]) == ("gpu-01", "the first node slurmctld lists; none is up")
    assert probe_candidate([]) is None


# ------------------------------------------------------------------------------ epilog


def epilog(programs: list[Path], **changes: object) -> EpilogFact:
    values: dict[str, object] = {
        "programs": tuple(program_file(str(path)) for path in programs),
        "slurm_user_groups": (64030,),
        "hook_default": HOOK_DEFAULT,
        "hook_socket": HOOK_DEFAULT,
        "poll_interval_s": 15.0,
    }
    return EpilogFact(**{**values, **changes})  # type: ignore[arg-type]


def wired(*paths: Path) -> SlurmFacts:
    return slurm(with_line("EpilogSlurmctld", ",".join(str(path) for path in paths)))


def script(path: Path, text: str, mode: int = 0o755) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_no_epilog_is_a_warning_with_the_slurm_conf_line() -> None:
    item = judge_epilog(epilog([]), slurm(), CONFIG)
    assert item.status is Status.WARN
    assert item.fact.startswith("EpilogSlurmctld is not set")
    assert "(every 15 s)" in item.fact
    assert item.action is not None
    assert f"`{HOOK_LINE}`" in item.action


def test_the_shipped_hook_is_known_under_any_name(tmp_path: Path) -> None:
    """What `slurm-medic install epilog FILE` writes, wherever the operator puts it."""
    shipped = files("daemon.installable").joinpath("epilog.py").read_text()
    hook = script(tmp_path / "medic-hook", shipped)
    item = judge_epilog(epilog([hook]), wired(hook), CONFIG)
    assert item == Item(
        "epilog",
        Status.OK,
        f"EpilogSlurmctld runs {hook}, slurm-medic's hook, executable by the SlurmUser slurm",
    )


def test_a_site_epilog_that_calls_the_hook_counts_and_one_that_does_not_warns(
    tmp_path: Path,
) -> None:
    calls = script(tmp_path / "site-epilog", "#!/bin/sh\n/etc/slurm/slurm-medic-epilog\n")
    assert judge_epilog(epilog([calls]), wired(calls), CONFIG).status is Status.OK
    other = script(tmp_path / "other-epilog", "#!/bin/sh\nlogger job ended\n")
    item = judge_epilog(epilog([other]), wired(other), CONFIG)
    assert item.status is Status.WARN
    assert item.fact == (
        f"EpilogSlurmctld runs {other}, which is not slurm-medic's hook and does not call it"
    )


def test_a_hook_slurmctld_cannot_run_fails(tmp_path: Path) -> None:
    missing = tmp_path / "slurm-medic-epilog"
    item = judge_epilog(epilog([missing]), wired(missing), CONFIG)
    assert (item.status, item.fact) == (
        Status.FAIL,
        f"EpilogSlurmctld names {missing}: not on this host",
    )
    private = script(missing, "#!/bin/sh\n", mode=0o700)  # root's own: slurm may not run it
    item = judge_epilog(epilog([private]), wired(private), CONFIG)
    assert item.status is Status.FAIL
    assert "which the SlurmUser slurm may not execute (mode 0700" in item.fact
    assert item.action == f"`chmod 0755 {private}`"
    directory = tmp_path / "dir" / "slurm-medic-epilog"
    directory.mkdir(parents=True)
    item = judge_epilog(epilog([directory]), wired(directory), CONFIG)
    assert (item.status, item.fact.endswith("not a regular file")) == (Status.FAIL, True)


def test_a_hook_socket_the_hook_does_not_send_to_is_a_warning(tmp_path: Path) -> None:
    hook = script(tmp_path / "slurm-medic-epilog", "#!/bin/sh\n")
    elsewhere = Path("/run/medic/other.sock")
    item = judge_epilog(epilog([hook], hook_socket=elsewhere), wired(hook), CONFIG)
    assert item.status is Status.WARN
    assert item.fact.endswith(f"but the daemon listens on {elsewhere} (hook_socket)")
    wrapper = script(
        tmp_path / "wrapper",
        f"#!/bin/sh\nSLURM_MEDIC_HOOK_SOCKET={elsewhere} exec {hook}\n",
    )
    fact = epilog([wrapper], hook_socket=elsewhere)
    assert judge_epilog(fact, wired(wrapper), CONFIG).status is Status.OK


def test_the_epilog_is_not_judged_without_slurmctlds_config() -> None:
    item = judge_epilog(epilog([]), NoAnswer("scontrol (slurmctld)", 65.0), CONFIG)
    assert item.status is Status.WARN
    assert item.fact.startswith("not checked")


# ------------------------------------------------------------------------------ sockets


def test_the_hook_socket_in_each_state(tmp_path: Path) -> None:
    path = tmp_path / "hook.sock"
    assert hook_fact(path).state is SocketState.MISSING
    assert judge_hook(hook_fact(path), CONFIG).status is Status.WARN
    with HookListener(path, on_job=lambda _job: None):
        fact = hook_fact(path)
        assert fact.state is SocketState.ANSWERS
        assert judge_hook(fact, CONFIG) == Item(
            "hook socket", Status.OK, f"the daemon listens on {path}"
        )
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: a daemon that died
    assert hook_fact(path).state is SocketState.REFUSED
    assert judge_hook(hook_fact(path), CONFIG).status is Status.WARN
    path.unlink()
    path.write_text("")
    fact = hook_fact(path)
    assert fact.state is SocketState.NOT_A_SOCKET
    item = judge_hook(fact, CONFIG)
    assert item.status is Status.FAIL
    assert item.action == f"remove {path}, or set hook_socket elsewhere in {CONFIG}"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: pytest shows the test's own output only."""


@pytest.fixture
def http_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def web_config(tmp_path: Path, section: str) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(f"[store]\nurl = 'sqlite+pysqlite:///{tmp_path}/medic.db'\n{section}")
    return config


def test_the_web_page_over_tcp_answers_healthz_or_is_named(
    tmp_path: Path, http_server: http.server.ThreadingHTTPServer
) -> None:
    port = http_server.server_address[1]
    settings = load_settings(web_config(tmp_path, f"[web]\nlisten = '127.0.0.1:{port}'\n"))
    fact = web_fact(settings)
    assert (fact.state, fact.status) == (SocketState.ANSWERS, 200)
    assert judge_web(fact, CONFIG) == Item(
        "web", Status.OK, f"slurm-medic web answers /healthz on http://127.0.0.1:{port}"
    )
    _Health.status = 503
    try:
        item = judge_web(web_fact(settings), CONFIG)
    finally:
        _Health.status = 200
    assert (item.status, "with HTTP 503" in item.fact) == (Status.FAIL, True)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    nobody = closed.getsockname()[1]
    closed.close()
    settings = load_settings(web_config(tmp_path, f"[web]\nlisten = '127.0.0.1:{nobody}'\n"))
    item = judge_web(web_fact(settings), CONFIG)
    assert item.status is Status.FAIL
    assert item.fact.startswith(
        f"nothing answers on http://127.0.0.1:{nobody} (connection refused)"
    )


def test_a_web_socket_that_is_not_there_fails_and_no_web_section_warns(tmp_path: Path) -> None:
    socket_path = tmp_path / "web.sock"
    settings = load_settings(web_config(tmp_path, f"[web]\nsocket = '{socket_path}'\n"))
    item = judge_web(web_fact(settings), CONFIG)
    assert (item.status, item.fact) == (
        Status.FAIL,
        f"nothing answers on {socket_path} (no such file): the proxy will find no web page",
    )
    unset = web_fact(load_settings(web_config(tmp_path, "")))
    assert unset == WebFact(configured=False)
    assert judge_web(unset, CONFIG).status is Status.WARN


# ------------------------------------------------------------------------------ the rest


def test_config_and_record_items() -> None:
    assert judge_config(ConfigFact(CONFIG, exists=True)).status is Status.OK
    assert judge_config(ConfigFact(CONFIG, exists=False)).status is Status.WARN
    bad = ConfigFact(
        CONFIG,
        exists=True,
        error=f"config {CONFIG}: 1 bad option(s)\n  probe: Value error, SSH key /k is not"
        " a readable file",
    )
    item = judge_config(bad)
    assert item.status is Status.FAIL
    assert item.fact == (
        f"config {CONFIG}: 1 bad option(s); probe: Value error, SSH key /k is not a readable file"
    )
    at_head = RecordFact("/var/lib/slurm-medic/medic.db", "0007", "0007")
    assert judge_record(at_head).status is Status.OK
    behind = judge_record(RecordFact("/db", "0007", "0005"))
    assert (behind.status, behind.action) == (Status.FAIL, "`slurm-medic db upgrade`")
    newer = judge_record(RecordFact("/db", "0007", "0099", known=False))
    assert "newer code wrote it" in newer.fact
    missing = judge_record(RecordFact("/db", "0007", missing=True))
    assert (missing.fact, missing.action) == ("no record at /db", "`slurm-medic db upgrade`")


def facts(**changes: object) -> Facts:
    values: dict[str, object] = {
        "config": ConfigFact(CONFIG, exists=True),
        "record": RecordFact("/db", "0007", "0007"),
        "slurm": slurm(),
        "accounting": AccountingFact(300.0, jobs=0),
        "probe": ProbeFact(None),
        "epilog": epilog([]),
        "hook": HookFact(HOOK_DEFAULT, SocketState.ANSWERS),
        "web": WebFact(configured=False),
    }
    return Facts(**{**values, **changes})  # type: ignore[arg-type]


def test_warnings_exit_0_and_a_failure_exits_1_in_the_same_document() -> None:
    report = judge(facts())
    assert [item.status for item in report.items].count(Status.WARN) == 3  # probe, epilog, web
    assert (report.failed, report.exit_code) == (False, 0)
    failing = judge(facts(accounting=NoAnswer("sacct (slurmdbd)", 65.0)))
    assert failing.exit_code == 1
    document = failing.document()
    assert (document["ok"], document["exit_code"], document["failed"]) == (False, 1, 1)
    checks = document["checks"]
    assert isinstance(checks, list)
    assert [check["name"] for check in checks] == [
        "config",
        "record",
        "slurm",
        "accounting",
        "probe",
        "epilog",
        "hook socket",
        "web",
    ]
    assert checks[3] == {
        "name": "accounting",
        "status": "fail",
        "fact": "no answer within 65 s from sacct (slurmdbd)",
        "action": "find out why sacct (slurmdbd) hangs; slurm-medic would wait on it too",
    }


def test_a_config_that_does_not_load_leaves_its_items_unchecked_not_failed() -> None:
    report = judge(
        facts(
            config=ConfigFact(CONFIG, exists=True, error="bad"),
            record=None,
            probe=None,
            hook=None,
            web=None,
        )
    )
    by_name = {item.name: item for item in report.items}
    assert by_name["config"].status is Status.FAIL
    for name in ("record", "probe", "hook socket", "web"):
        assert by_name[name].status is Status.WARN
        assert by_name[name].fact == "not checked: the config does not load (see config)"
    assert by_name["slurm"].status is Status.OK  # still asked
    assert Report(report.items).exit_code == 1


def test_a_hung_check_is_cut_at_its_time_and_a_broken_one_is_said() -> None:
    release = threading.Event()
    started = time.monotonic()
    hung = Bounded(lambda: release.wait(30), waiting_on="a thing", seconds=0.3)
    broken = Bounded(lambda: 1 // 0, waiting_on="another", seconds=5)
    quick = Bounded(lambda: "answer", waiting_on="quick", seconds=5)
    assert hung.result() == NoAnswer("a thing", 0.3)
    assert time.monotonic() - started < 2
    assert broken.result() == NoAnswer(
        "another", 5, "ZeroDivisionError: integer division or modulo by zero"
    )
    assert quick.result() == "answer"
    release.set()


@pytest.mark.root  # sudo's SUDO_UID is believed only by a root process
def test_a_config_refused_under_sudo_exits_2_before_any_check(tmp_path: Path) -> None:
    config = web_config(tmp_path, "")
    result = CliRunner().invoke(main, ["doctor", "--config", str(config)], env={"SUDO_UID": "1001"})
    assert result.exit_code == 2
    assert "refused: --config" in result.output
