"""The I/O edge of `doctor`: each item's facts, gathered through the project's own seams.

Slurm through `daemon.process.run` and the Slurm layer (one try each, no retries: a doctor
reports what it finds), the node through the SSH seam exactly as the daemon probes it, the
record through the engine factory opened read-only, the sockets with the standard library.
Every item runs in a thread of its own and is waited for until its own time limit: one that
hangs or breaks becomes a `NoAnswer` and never holds up or stops the others (the thread is a
daemon thread, left behind when the command exits).
"""

from __future__ import annotations

import http.client
import os
import pwd
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Generic, TypeVar

from daemon import process
from daemon.config import Settings
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
    ProgramFile,
    RecordFact,
    SlurmFacts,
    SocketState,
    WebFact,
)
from daemon.doctor.judge import controller_config, probe_candidate
from daemon.evidence.prober import ProbeSettings, run_probe_program
from daemon.slurm.backend import SlurmCli
from daemon.slurm.controller import SHOW_CONFIG_ARGV, VERSION_ARGV, ControllerConfig
from daemon.slurm.errors import SlurmCommandError, SlurmError, SlurmParseError, SlurmUnavailable
from daemon.ssh import (
    AuthenticationFailed,
    CommandTimedOut,
    HostKeyMismatch,
    OutputTooLarge,
    SshError,
    UnknownHostKey,
    Unreachable,
    UnsafeKey,
    check_private_key,
)
from daemon.web.settings import split_listen

T = TypeVar("T")

# Over each item's own limits (the commands', the SSH seam's), for the thread that runs it.
GRACE_S = 5.0
RECORD_TIMEOUT_S = 20.0  # a database that does not answer in this long would stall the daemon
SOCKET_TIMEOUT_S = 5.0
# The accounting check is the daemon's own poll over a short window: a busy cluster's last
# five minutes are a few hundred records, read in well under a second.
ACCOUNTING_WINDOW_S = 300.0
# Enough of a program to see whether it is, or calls, the hook; never a whole binary.
PROGRAM_HEAD_BYTES = 64 * 1024
HEALTHZ_BODY_BYTES = 1024
# The settings' own defaults, for the checks that run when the config does not load.
DEFAULT_SLURM_TIMEOUT_S = float(Settings.model_fields["slurm_timeout_s"].default)
HOOK_DEFAULT = Path(str(Settings.model_fields["hook_socket"].default))


class Bounded(Generic[T]):
    """One item's gathering in a daemon thread; its result, or a `NoAnswer` past `seconds`."""

    def __init__(self, work: Callable[[], T], *, waiting_on: str, seconds: float) -> None:
        self._work = work
        self._waiting_on = waiting_on
        self._seconds = seconds
        self._results: list[T] = []
        self._errors: list[str] = []
        self._deadline = time.monotonic() + seconds
        self._thread = threading.Thread(target=self._run, name=f"doctor {waiting_on}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._results.append(self._work())
        except Exception as error:  # a fault of the check: said as such, the others go on
            self._errors.append(f"{type(error).__name__}: {error}")

    def result(self) -> T | NoAnswer:
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._results:
            return self._results[0]
        error = self._errors[0] if self._errors else None
        return NoAnswer(self._waiting_on, self._seconds, error)


def gather(config: ConfigFact, settings: Settings | None, *, node: str | None) -> Facts:
    """Every item at once, each within its own limit; `settings` None: the config failed, and
    only what needs no config (Slurm, accounting, EpilogSlurmctld) is asked."""
    timeout = settings.slurm_timeout_s if settings is not None else DEFAULT_SLURM_TIMEOUT_S
    slurm = Bounded(
        lambda: _slurm_and_epilog(timeout, settings),
        waiting_on="scontrol (slurmctld)",
        seconds=2 * timeout + GRACE_S,
    )
    accounting = Bounded(
        lambda: _accounting(timeout),
        waiting_on="sacct (slurmdbd)",
        seconds=2 * timeout + GRACE_S,  # --json, and --parsable2 where there is no --json
    )
    record = probe = hook = web = None
    if settings is not None:
        record = Bounded(
            lambda: _record(settings), waiting_on="the record's database", seconds=RECORD_TIMEOUT_S
        )
        probe = Bounded(
            lambda: _probe(settings.probe, node, timeout),
            waiting_on=f"SSH to {node or 'the node'}",
            seconds=_probe_seconds(settings.probe, timeout),
        )
        hook = Bounded(
            lambda: hook_fact(settings.hook_socket),
            waiting_on="the hook socket",
            seconds=SOCKET_TIMEOUT_S + GRACE_S,
        )
        web = Bounded(
            lambda: web_fact(settings),
            waiting_on="slurm-medic web",
            seconds=SOCKET_TIMEOUT_S + GRACE_S,
        )
    slurm_facts = slurm.result()
    return Facts(
        config=config,
        record=record.result() if record is not None else None,
        slurm=slurm_facts if isinstance(slurm_facts, NoAnswer) else slurm_facts[0],
        accounting=accounting.result(),
        probe=probe.result() if probe is not None else None,
        epilog=slurm_facts if isinstance(slurm_facts, NoAnswer) else slurm_facts[1],
        hook=hook.result() if hook is not None else None,
        web=web.result() if web is not None else None,
    )


def _probe_seconds(settings: ProbeSettings | None, slurm_timeout: float) -> float:
    if settings is None:
        return GRACE_S
    return slurm_timeout + settings.connect_timeout_s + settings.command_timeout_s + GRACE_S


# ------------------------------------------------------------------------------ Slurm


def _command(argv: Sequence[str], timeout: float) -> CommandAnswer:
    try:
        result = process.run(argv, timeout=timeout)
    except process.CommandTimeout as error:
        return CommandAnswer(tuple(argv), None, failure=str(error), timed_out=True)
    except process.CommandError as error:
        return CommandAnswer(tuple(argv), None, failure=str(error))
    return CommandAnswer(result.argv, result.returncode, result.stdout, result.stderr)


def _slurm_and_epilog(timeout: float, settings: Settings | None) -> tuple[SlurmFacts, EpilogFact]:
    """The client's release, slurmctld's configuration, and the programs it names as
    EpilogSlurmctld as this host has them (the daemon runs where slurmctld does)."""
    facts = SlurmFacts(
        version=_command(VERSION_ARGV, timeout),
        show_config=_command(SHOW_CONFIG_ARGV, timeout),
        timeout_s=timeout,
    )
    return facts, _epilog(controller_config(facts), settings)


def _accounting(timeout: float) -> AccountingFact:
    """The daemon's own finished-job query, once, over the last few minutes."""
    until = datetime.now(UTC)
    cli = SlurmCli(timeout_s=timeout, attempts=1)
    try:
        window = cli.finished_window(until - timedelta(seconds=ACCOUNTING_WINDOW_S), until)
    except SlurmUnavailable as error:
        return _accounting_error(AccountingError.UNAVAILABLE, error.last_error)
    except SlurmParseError as error:
        return _accounting_error(AccountingError.UNREADABLE, str(error))
    except SlurmCommandError as error:
        said = [line.strip() for line in error.stderr.splitlines() if line.strip()]
        return _accounting_error(AccountingError.FAILED, said[-1] if said else str(error))
    return AccountingFact(ACCOUNTING_WINDOW_S, jobs=len(window.jobs))


def _accounting_error(kind: AccountingError, said: str) -> AccountingFact:
    return AccountingFact(ACCOUNTING_WINDOW_S, error=kind, said=said)


def _epilog(config: ControllerConfig | None, settings: Settings | None) -> EpilogFact:
    user = config.slurm_user if config is not None else None
    return EpilogFact(
        programs=tuple(program_file(path) for path in (config.epilog_slurmctld if config else ())),
        slurm_user_groups=_groups(user),
        hook_default=HOOK_DEFAULT,
        hook_socket=settings.hook_socket if settings is not None else None,
        poll_interval_s=settings.watcher.poll_interval_s if settings is not None else None,
    )


def _groups(user: tuple[str, int] | None) -> tuple[int, ...]:
    if user is None:
        return ()
    try:
        entry = pwd.getpwuid(user[1])
    except KeyError:
        return ()
    return tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))


def program_file(path: str) -> ProgramFile:
    """The file as slurmctld would execute it (a link followed), and its first bytes."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return ProgramFile(path, exists=False)
    except OSError as error:
        return ProgramFile(path, exists=True, error=error.strerror)
    found = ProgramFile(
        path,
        exists=True,
        regular=stat.S_ISREG(info.st_mode),
        mode=info.st_mode,
        uid=info.st_uid,
        gid=info.st_gid,
    )
    if not found.regular:
        return found
    try:
        # Non-blocking: a FIFO put in its place since the stat must not hold the check.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        with os.fdopen(descriptor, "rb") as stream:
            head = stream.read(PROGRAM_HEAD_BYTES)
    except OSError as error:
        return ProgramFile(path, exists=True, regular=True, error=error.strerror)
    return ProgramFile(
        path,
        exists=True,
        regular=True,
        mode=info.st_mode,
        uid=info.st_uid,
        gid=info.st_gid,
        text=head.decode("utf-8", errors="replace"),
    )


# ------------------------------------------------------------------------------ the node


def _probe(settings: ProbeSettings | None, node: str | None, slurm_timeout: float) -> ProbeFact:
    """One probe of one node over the SSH seam, as the daemon runs it, each refusal by type."""
    if settings is None:
        return ProbeFact(None)
    chosen_by = "--node"
    if node is None:
        try:
            nodes = SlurmCli(timeout_s=slurm_timeout, attempts=1).nodes()
        except SlurmError as error:
            detail = f"slurmctld's node list cannot be read ({error})"
            return ProbeFact(settings, outcome=ProbeOutcome.NO_NODE, detail=detail)
        picked = probe_candidate(nodes)
        if picked is None:
            detail = "slurmctld lists no node"
            return ProbeFact(settings, outcome=ProbeOutcome.NO_NODE, detail=detail)
        node, chosen_by = picked

    def refused(outcome: ProbeOutcome, error: Exception) -> ProbeFact:
        return ProbeFact(settings, node, chosen_by, outcome, detail=str(error))

    try:
        check_private_key(settings.key_path)
    except UnsafeKey as error:
        return refused(ProbeOutcome.KEY_UNSAFE, error)
    started = time.monotonic()
    try:
        result = run_probe_program(settings, node)
    except UnknownHostKey as error:
        return refused(ProbeOutcome.UNKNOWN_HOST, error)
    except HostKeyMismatch as error:
        return refused(ProbeOutcome.HOST_KEY_CHANGED, error)
    except AuthenticationFailed as error:
        return refused(ProbeOutcome.KEY_REFUSED, error)
    except CommandTimedOut as error:
        return refused(ProbeOutcome.TIMED_OUT, error)
    except OutputTooLarge as error:
        return refused(ProbeOutcome.TOO_MUCH_OUTPUT, error)
    except Unreachable as error:
        return refused(ProbeOutcome.UNREACHABLE, error)
    except SshError as error:  # the key or known_hosts cannot be read
        return refused(ProbeOutcome.KEY_UNREADABLE, error)
    took = time.monotonic() - started
    if result.exit_status != 0:
        said = result.stderr.strip().splitlines()[-1:] or [f"exit {result.exit_status}"]
        return ProbeFact(
            settings, node, chosen_by, ProbeOutcome.PROBE_EXIT, said[0][:400], duration_s=took
        )
    return ProbeFact(
        settings,
        node,
        chosen_by,
        ProbeOutcome.ANSWERED,
        document=result.stdout,
        probed_at=datetime.now(UTC),
        duration_s=took,
    )


# ------------------------------------------------------------------------------ sockets


def hook_fact(path: Path) -> HookFact:
    """Whether a datagram socket listens at `path`: a connect, no datagram sent."""
    state = _socket_file(path)
    if state is not None:
        return HookFact(path, state[0], state[1])
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except ConnectionRefusedError:
            return HookFact(path, SocketState.REFUSED)
        except TimeoutError:
            return HookFact(path, SocketState.NO_ANSWER, f"no answer within {SOCKET_TIMEOUT_S:g} s")
        except OSError as error:
            return HookFact(path, SocketState.FAILED, error.strerror or str(error))
    return HookFact(path, SocketState.ANSWERS)


def _socket_file(path: Path) -> tuple[SocketState, str] | None:
    """Why `path` cannot be a listening socket, or None when it is a socket file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return SocketState.MISSING, "no such file"
    except OSError as error:
        return SocketState.FAILED, error.strerror or str(error)
    return None if stat.S_ISSOCK(mode) else (SocketState.NOT_A_SOCKET, "not a socket")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix stream socket, as the proxy reaches `slurm-medic web`."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def web_fact(settings: Settings) -> WebFact:
    """GET /healthz where the config says the web page is: its socket, else its address."""
    web = settings.web
    if web.socket is None and "web" not in settings.model_fields_set:
        return WebFact(configured=False)
    connection: http.client.HTTPConnection
    if web.socket is not None:
        where = str(web.socket)
        state = _socket_file(web.socket)
        if state is not None:
            return WebFact(True, where, state[0], detail=state[1])
        connection = _UnixHTTPConnection(web.socket, SOCKET_TIMEOUT_S)
    else:
        where = f"http://{web.listen}"
        host, port = split_listen(web.listen)
        connection = http.client.HTTPConnection(host, port, timeout=SOCKET_TIMEOUT_S)
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read(HEALTHZ_BODY_BYTES)
    except ConnectionRefusedError:
        return WebFact(True, where, SocketState.REFUSED, detail="connection refused")
    except TimeoutError:
        detail = f"no answer within {SOCKET_TIMEOUT_S:g} s"
        return WebFact(True, where, SocketState.NO_ANSWER, detail=detail)
    except (OSError, http.client.HTTPException) as error:
        return WebFact(True, where, SocketState.FAILED, detail=str(error) or type(error).__name__)
    finally:
        connection.close()
    return WebFact(True, where, SocketState.ANSWERS, status=response.status)


# ------------------------------------------------------------------------------ the record


def _record(settings: Settings) -> RecordFact:
    """The record's schema revision, read-only: a doctor never creates or migrates it."""
    from alembic.script import ScriptDirectory  # noqa: PLC0415  (the record's layers, here only)
    from sqlalchemy.exc import DBAPIError  # noqa: PLC0415

    from daemon.store import schema  # noqa: PLC0415
    from daemon.store.engine import (  # noqa: PLC0415
        Access,
        NoRecord,
        RecordUnavailable,
        StoreConfigError,
        describe_failure,
        make_engine,
        normalise_url,
        record_location,
    )

    head = schema.head_revision()
    try:
        location = record_location(normalise_url(settings.store.url))
    except StoreConfigError as error:  # named by its option: the URL may hold a password
        return RecordFact("[store] url", head, error=f"[store] url: {error}")
    try:
        engine = make_engine(settings.store, access=Access.READ)
    except NoRecord:
        return RecordFact(location, head, missing=True)
    except RecordUnavailable as error:
        return RecordFact(location, head, error=str(error))
    try:
        revision = schema.current_revision(engine)
    except DBAPIError as error:
        return RecordFact(location, head, error=describe_failure(error, engine.url))
    finally:
        engine.dispose()
    scripts = ScriptDirectory.from_config(schema.alembic_config())
    known = revision is None or revision in {script.revision for script in scripts.walk_revisions()}
    return RecordFact(location, head, revision, known=known)
