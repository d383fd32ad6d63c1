"""Facts -> one line per item: ok, warn or fail, the fact, and for a warn or a fail what to do.

Pure: it reads the facts, and Slurm's and the probe's outputs through their own parsers, and
imports no seam. A warn is something slurm-medic works without (no probe, no hook, no web
page), or could not tell; a fail is something that stops it working or makes it wrong, and
makes `doctor` exit 1.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

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
from daemon.evidence.nvidia_smi import MIB
from daemon.evidence.probe import ProbeDocumentError, interpret_probe, parse_document
from daemon.evidence.prober import ProbeSettings
from daemon.evidence.records import ProbeVerdict
from daemon.slurm.controller import (
    ControllerConfig,
    parse_release,
    parse_show_config,
    release_number,
)
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import NodeBaseState, SlurmNode
from daemon.store.engine import UPGRADE_COMMAND

EXIT_OK = 0
EXIT_FAILED = 1

CONFIG, RECORD, SLURM, ACCOUNTING = "config", "record", "slurm", "accounting"
PROBE, EPILOG, HOOK, WEB = "probe", "epilog", "hook socket", "web"

# The oldest release the Slurm layer is tested on, with its real output (tests/data/slurm).
OLDEST_TESTED = (22, 5)
SLURMDBD_STORAGE = "accounting_storage/slurmdbd"
# A relaunch is known by the token slurm-medic puts in its comment: accounting must keep it.
COMMENT_FLAG = "job_comment"
# Where deploy/README.md installs the hook, and the names by which it is known.
HOOK_INSTALL_PATH = "/etc/slurm/slurm-medic-epilog"
HOOK_NAME = "slurm-medic-epilog"
HOOK_SOCKET_ENV = "SLURM_MEDIC_HOOK_SOCKET"
PROBE_README = "deploy/node-probe/README.md"
_REFUSED = re.compile(r"Connection refused", re.IGNORECASE)
_MUNGE = re.compile(r"munge", re.IGNORECASE)
_UNUSABLE_NODE = frozenset({NodeBaseState.DOWN, NodeBaseState.FUTURE, NodeBaseState.ERROR})

T = TypeVar("T")


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Item:
    """One thing checked: how it stands, the fact in one line, and what to do about it."""

    name: str
    status: Status
    fact: str
    action: str | None = None


@dataclass(frozen=True)
class Report:
    items: tuple[Item, ...]

    @property
    def failed(self) -> bool:
        return any(item.status is Status.FAIL for item in self.items)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.failed else EXIT_OK

    def count(self, status: Status) -> int:
        return sum(item.status is status for item in self.items)

    def document(self) -> dict[str, object]:
        """The `--json` document: the same items, and the exit code they give."""
        return {
            "ok": not self.failed,
            "exit_code": self.exit_code,
            "failed": self.count(Status.FAIL),
            "warnings": self.count(Status.WARN),
            "checks": [
                {
                    "name": item.name,
                    "status": item.status.value,
                    "fact": item.fact,
                    "action": item.action,
                }
                for item in self.items
            ],
        }


def judge(facts: Facts) -> Report:
    """Every item, in the order an operator would fix them."""
    path = facts.config.path
    return Report(
        (
            judge_config(facts.config),
            _item(RECORD, facts.record, judge_record),
            _item(SLURM, facts.slurm, judge_slurm),
            _item(ACCOUNTING, facts.accounting, lambda fact: judge_accounting(fact, facts.slurm)),
            _item(PROBE, facts.probe, lambda fact: judge_probe(fact, path)),
            _item(EPILOG, facts.epilog, lambda fact: judge_epilog(fact, facts.slurm, path)),
            _item(HOOK, facts.hook, lambda fact: judge_hook(fact, path)),
            _item(WEB, facts.web, lambda fact: judge_web(fact, path)),
        )
    )


def _item(name: str, fact: T | NoAnswer | None, judged: Callable[[T], Item]) -> Item:
    if fact is None:
        return Item(name, Status.WARN, "not checked: the config does not load (see config)")
    if isinstance(fact, NoAnswer):
        if fact.error is not None:
            return Item(
                name,
                Status.FAIL,
                f"the check itself failed: {fact.error}",
                "report this: it is a fault of `slurm-medic doctor`, not of this host",
            )
        return Item(
            name,
            Status.FAIL,
            f"no answer within {fact.seconds:g} s from {fact.waiting_on}",
            f"find out why {fact.waiting_on} hangs; slurm-medic would wait on it too",
        )
    return judged(fact)


def judge_config(fact: ConfigFact) -> Item:
    if fact.error is not None:
        said = "; ".join(line.strip() for line in fact.error.splitlines() if line.strip())
        return Item(
            CONFIG,
            Status.FAIL,
            said,
            f"correct what is named in {fact.path} (`slurm-medic install config FILE` writes"
            " every option), then run `slurm-medic doctor` again",
        )
    if not fact.exists:
        return Item(
            CONFIG,
            Status.WARN,
            f"no config file at {fact.path}: every option has its default (no [probe], no [web])",
            f"`slurm-medic install config {fact.path}`, then edit it (deploy/README.md, 3)",
        )
    return Item(CONFIG, Status.OK, f"{fact.path} loads")


def judge_record(fact: RecordFact) -> Item:
    where = f"the record at {fact.location}"
    if fact.missing:
        return Item(RECORD, Status.FAIL, f"no record at {fact.location}", f"`{UPGRADE_COMMAND}`")
    if fact.error is not None:
        return Item(
            RECORD,
            Status.FAIL,
            fact.error,
            "check [store] url in the config and that its database answers"
            " (`slurm-medic db current`)",
        )
    if fact.revision is None:
        return Item(RECORD, Status.FAIL, f"{where} has no schema", f"`{UPGRADE_COMMAND}`")
    if not fact.known:
        return Item(
            RECORD,
            Status.FAIL,
            f"{where} is at revision {fact.revision}, which this slurm-medic does not know"
            " (newer code wrote it)",
            "upgrade slurm-medic, or downgrade the record with the code that wrote it",
        )
    if fact.revision != fact.head:
        return Item(
            RECORD,
            Status.FAIL,
            f"{where} is at revision {fact.revision}, behind this code's {fact.head}:"
            " the daemon refuses to start on it",
            f"`{UPGRADE_COMMAND}`",
        )
    return Item(RECORD, Status.OK, f"{where} is at this code's schema ({fact.head})")


def controller_config(slurm: SlurmFacts | NoAnswer) -> ControllerConfig | None:
    """slurmctld's configuration, when it answered and could be read."""
    if isinstance(slurm, NoAnswer) or not slurm.show_config.ok:
        return None
    try:
        return parse_show_config(slurm.show_config.stdout)
    except SlurmParseError:
        return None


def judge_slurm(facts: SlurmFacts) -> Item:
    version = facts.version
    if not version.ok:
        return Item(
            SLURM,
            Status.FAIL,
            f"scontrol does not run here: {version.said()}",
            "install Slurm's client commands on this host (Debian: slurm-client), with the"
            " cluster's slurm.conf and munge key",
        )
    client = parse_release(version.stdout)
    here = f"scontrol {client or '(release not read)'}"
    shown = facts.show_config
    if not shown.ok:
        return Item(
            SLURM,
            Status.FAIL,
            f"{here} runs, but slurmctld does not answer: {shown.said()}",
            _controller_action(shown),
        )
    try:
        config = parse_show_config(shown.stdout)
    except SlurmParseError as error:
        return Item(
            SLURM,
            Status.FAIL,
            f"`scontrol show config` cannot be read: {error}",
            "report this with what `scontrol show config` prints",
        )
    server = config.release
    at = f" on {config.controller_host}" if config.controller_host else ""
    cluster = f", cluster {config.get('ClusterName')}" if config.get("ClusterName") else ""
    fact = f"{here}; slurmctld {server or '(release not read)'}{at} answers{cluster}"
    numbers = release_number(server or client or "")
    if numbers is not None and numbers < OLDEST_TESTED:
        return Item(
            SLURM,
            Status.WARN,
            f"{fact}: older than {OLDEST_TESTED[0]}.{OLDEST_TESTED[1]:02d}, the oldest release"
            " slurm-medic is tested on",
            "upgrade Slurm; until then read `slurm-medic history` closely",
        )
    if client and server and release_number(client) != release_number(server):
        return Item(
            SLURM,
            Status.WARN,
            f"{fact}: the client commands here are not slurmctld's release",
            f"install the client commands of Slurm {server} on this host",
        )
    return Item(SLURM, Status.OK, fact)


def _controller_action(answer: CommandAnswer) -> str:
    if _MUNGE.search(answer.stderr):
        return (
            "munged must run here with the cluster's key: `systemctl start munge`, then"
            " `munge -n | unmunge`"
        )
    return (
        "start slurmctld (`systemctl start slurmctld`; its log says why it stopped), or point"
        " this host's slurm.conf at it; `scontrol ping` names the controller asked"
    )


def judge_accounting(fact: AccountingFact, slurm: SlurmFacts | NoAnswer) -> Item:
    config = controller_config(slurm)
    address = config.accounting_address if config is not None else None
    where = f"slurmdbd at {address}" if address else "slurmdbd"
    if config is not None and config.get("AccountingStorageType") != SLURMDBD_STORAGE:
        return Item(
            ACCOUNTING,
            Status.FAIL,
            f"AccountingStorageType is {config.get('AccountingStorageType') or 'not set'}:"
            " without slurmdbd, sacct has no finished job to read",
            f"run slurmdbd and set `AccountingStorageType={SLURMDBD_STORAGE}` in slurm.conf,"
            " then restart slurmctld",
        )
    if fact.error is AccountingError.UNAVAILABLE:
        start = (
            "start slurmdbd (`systemctl start slurmdbd`; its log says why it stopped), then"
            " check that `sacctmgr show cluster` answers"
        )
        if _REFUSED.search(fact.said):
            return Item(
                ACCOUNTING,
                Status.FAIL,
                f"{where} refuses connections: slurmdbd is not running ({fact.said})",
                start,
            )
        return Item(ACCOUNTING, Status.FAIL, f"{where} does not answer sacct: {fact.said}", start)
    if fact.error is AccountingError.FAILED:
        return Item(
            ACCOUNTING,
            Status.FAIL,
            f"sacct fails: {fact.said}",
            "run `sacct -X --starttime now-1hour` as root to see the whole error",
        )
    if fact.error is AccountingError.UNREADABLE:
        return Item(
            ACCOUNTING,
            Status.FAIL,
            f"sacct answers, but not in a form this slurm-medic reads: {fact.said}",
            "report this with the Slurm release (`sacct --version`)",
        )
    minutes = f"{fact.window_s / 60:g} min"
    answered = f"sacct reads {where}: {fact.jobs} job(s) ended in the last {minutes}"
    if config is None:
        return Item(
            ACCOUNTING,
            Status.WARN,
            f"{answered}; whether it keeps job comments is unknown (slurmctld did not answer)",
            "see the slurm item, then run `slurm-medic doctor` again",
        )
    if COMMENT_FLAG not in config.store_flags:
        flags = ",".join(config.store_flags) or "not set"
        return Item(
            ACCOUNTING,
            Status.FAIL,
            f"{answered}, but AccountingStoreFlags is {flags}: accounting drops job comments,"
            " and a relaunch is known by the token in its comment",
            f"add `AccountingStoreFlags={COMMENT_FLAG}` to slurm.conf, then restart slurmctld",
        )
    return Item(ACCOUNTING, Status.OK, f"{answered}; job comments are kept")


def probe_candidate(nodes: Sequence[SlurmNode]) -> tuple[str, str] | None:
    """The node a check probes, and how it was picked: the first slurmctld lists that is up
    and responding (a down node's silence says nothing of the key), else the first."""
    for node in nodes:
        if node.state not in _UNUSABLE_NODE and "NOT_RESPONDING" not in node.flags:
            return node.name, "the first node slurmctld lists that is up"
    return (nodes[0].name, "the first node slurmctld lists; none is up") if nodes else None


def judge_probe(fact: ProbeFact, config_path: Path) -> Item:
    settings = fact.settings
    if settings is None:
        return Item(
            PROBE,
            Status.WARN,
            "not configured: without [probe] no node is ever probed, so a GPU fault (XID, row"
            " remap, ECC) or another job on the GPUs cannot be told from the program's own OOM,"
            " no node is drained for one, and the sweep cannot run",
            f"install the node probe (`slurm-medic install node-probe`, {PROBE_README}), then"
            f" set [probe] key_path and known_hosts_path in {config_path}",
        )
    node = fact.node or "the node"
    key, known = settings.key_path, settings.known_hosts_path
    account = f"{settings.user}@{node}:{settings.port}"
    failures: dict[ProbeOutcome, tuple[str, str]] = {
        ProbeOutcome.NO_NODE: (
            f"no node to probe: {fact.detail}",
            "name one: `slurm-medic doctor --node NODE`",
        ),
        ProbeOutcome.KEY_UNSAFE: (
            fact.detail,
            f"`chown root: {key}; chmod 600 {key}`: the daemon's own, read by no one else",
        ),
        ProbeOutcome.KEY_UNREADABLE: (
            fact.detail,
            f"check key_path and known_hosts_path in {config_path}",
        ),
        ProbeOutcome.UNKNOWN_HOST: (
            f"{known} has no host key for {node}: the probe refuses it ({fact.detail})",
            f"add {node}'s host key to {known}, checked against the node's own fingerprint"
            f" ({PROBE_README}, pinned host keys)",
        ),
        ProbeOutcome.HOST_KEY_CHANGED: (
            f"{node} offers another host key than {known} pins: {fact.detail}",
            f"if {node} was rebuilt, `ssh-keygen -R {node} -f {known}` and add its new key;"
            " otherwise find out who answers as it",
        ),
        ProbeOutcome.KEY_REFUSED: (
            f"{account} refuses the key {key}: {fact.detail}",
            f"install {key}.pub in {settings.user}'s authorized_keys on the nodes, with the"
            f" forced command ({PROBE_README})",
        ),
        ProbeOutcome.UNREACHABLE: (
            f"no SSH session to {account}: {fact.detail}",
            f"is sshd running on {node} (port {settings.port}), and does this host reach it?",
        ),
        ProbeOutcome.TIMED_OUT: (
            f"{node}'s probe ran past command_timeout_s ({settings.command_timeout_s:g} s)",
            f"find out why {node} is slow, or raise [probe] command_timeout_s in {config_path}",
        ),
        ProbeOutcome.TOO_MUCH_OUTPUT: (
            f"{node}'s probe printed more than max_output_bytes: {fact.detail}",
            f"see what `medic-node-probe` prints on {node}",
        ),
        ProbeOutcome.PROBE_EXIT: (
            f"{node} let the key in, but the probe program failed: {fact.detail}",
            f"run medic-node-probe on {node} as {settings.user} to see why ({PROBE_README})",
        ),
    }
    if fact.outcome in failures:
        said, action = failures[fact.outcome]
        return Item(PROBE, Status.FAIL, said, action)
    text = fact.document or ""
    try:
        parse_document(text)
    except ProbeDocumentError as error:
        return Item(
            PROBE,
            Status.FAIL,
            f"{node} let the key in, but did not answer with the probe's document: {error}",
            f"the key's forced command on {node} must be medic-node-probe ({PROBE_README})",
        )
    probe = interpret_probe(
        node,
        text,
        probed_at=fact.probed_at or datetime.now(UTC),
        catalog=settings.catalog(),
        cotenant_min_bytes=settings.cotenant_min_mib * MIB,
    )
    answered = f"{node} ({fact.chosen_by}) answered the probe over SSH as {settings.user}"
    took = f"in {fact.duration_s:.1f} s"
    if probe.verdict is ProbeVerdict.UNREACHABLE:
        return Item(
            PROBE,
            Status.WARN,
            f"{answered} {took}, but its state could not be read: {probe.reasons[0]}",
            f"{_probe_command(settings, node)} shows each tool's error",
        )
    if probe.verdict is ProbeVerdict.HEALTHY:
        return Item(PROBE, Status.OK, f"{answered} {took}: healthy")
    return Item(
        PROBE,
        Status.OK,
        f"{answered} {took}: {probe.verdict.value} ({_probe_command(settings, node)} says why)",
    )


def _probe_command(settings: ProbeSettings, node: str) -> str:
    return (
        f"`slurm-medic probe {node} --key {settings.key_path} --known-hosts"
        f" {settings.known_hosts_path} --user {settings.user} --port {settings.port}`"
    )


def is_hook(program: ProgramFile) -> bool:
    """slurm-medic's hook itself (or its console script), or a script that calls it."""
    return (
        Path(program.path).name == HOOK_NAME
        or HOOK_NAME in program.text
        or HOOK_SOCKET_ENV in program.text
    )


def executable_by(
    program: ProgramFile, user: tuple[str, int] | None, groups: Sequence[int]
) -> bool:
    """Whether the SlurmUser may execute the file, by its mode bits (root: any x bit)."""
    if user is None or user[1] == 0:
        return bool(program.mode & 0o111)
    if program.uid == user[1]:
        return bool(program.mode & stat.S_IXUSR)
    if program.gid in groups:
        return bool(program.mode & stat.S_IXGRP)
    return bool(program.mode & stat.S_IXOTH)


def judge_epilog(fact: EpilogFact, slurm: SlurmFacts | NoAnswer, config_path: Path) -> Item:
    config = controller_config(slurm)
    if config is None:
        return Item(
            EPILOG,
            Status.WARN,
            "not checked: slurmctld's configuration could not be read (see slurm)",
        )
    line = f"EpilogSlurmctld={HOOK_INSTALL_PATH}"
    if not fact.programs:
        every = f"every {fact.poll_interval_s:g} s" if fact.poll_interval_s else "a poll interval"
        return Item(
            EPILOG,
            Status.WARN,
            "EpilogSlurmctld is not set: the daemon learns that a job ended at its next poll"
            f" ({every}) rather than within a second",
            f"`slurm-medic install epilog {HOOK_INSTALL_PATH}`, add `{line}` to slurm.conf,"
            " then `scontrol reconfigure` (deploy/README.md, 5)",
        )
    hooks = [program for program in fact.programs if is_hook(program)]
    if not hooks:
        named = ", ".join(program.path for program in fact.programs)
        return Item(
            EPILOG,
            Status.WARN,
            f"EpilogSlurmctld runs {named}, which is not slurm-medic's hook and does not call it",
            f"call {HOOK_INSTALL_PATH} from it as its last line, or add the hook to"
            " EpilogSlurmctld (a comma-separated list from Slurm 23.02)",
        )
    program = hooks[0]
    user = config.slurm_user
    who = f"the SlurmUser {user[0]}" if user else "the SlurmUser"
    if not program.exists or not program.regular or program.error is not None:
        found = program.error or ("not a regular file" if program.exists else "not on this host")
        return Item(
            EPILOG,
            Status.FAIL,
            f"EpilogSlurmctld names {program.path}: {found}",
            f"`slurm-medic install epilog {program.path}` (deploy/README.md, 5)",
        )
    if not executable_by(program, user, fact.slurm_user_groups):
        return Item(
            EPILOG,
            Status.FAIL,
            f"EpilogSlurmctld names {program.path}, which {who} may not execute"
            f" (mode {stat.S_IMODE(program.mode):04o}, owner uid {program.uid})",
            f"`chmod 0755 {program.path}`",
        )
    socket = fact.hook_socket
    if socket is not None and socket != fact.hook_default and str(socket) not in program.text:
        return Item(
            EPILOG,
            Status.WARN,
            f"EpilogSlurmctld runs {program.path}, which sends to {fact.hook_default}, but the"
            f" daemon listens on {socket} (hook_socket)",
            f'set `hook_socket = "{fact.hook_default}"` in {config_path}, or let EpilogSlurmctld'
            f" run a wrapper that calls the hook with {HOOK_SOCKET_ENV}={socket}",
        )
    return Item(
        EPILOG,
        Status.OK,
        f"EpilogSlurmctld runs {program.path}, slurm-medic's hook, executable by {who}",
    )


def judge_hook(fact: HookFact, config_path: Path) -> Item:
    start = (
        "`systemctl start slurm-medic`; if it runs, `journalctl -u slurm-medic` says why it"
        " does not listen there"
    )
    match fact.state:
        case SocketState.ANSWERS:
            return Item(HOOK, Status.OK, f"the daemon listens on {fact.path}")
        case SocketState.MISSING:
            return Item(
                HOOK,
                Status.WARN,
                f"nothing at {fact.path}: the daemon is not running, or could not listen there"
                " (it then polls only)",
                start,
            )
        case SocketState.REFUSED:
            return Item(
                HOOK,
                Status.WARN,
                f"{fact.path} is a socket no one listens on: the daemon that made it stopped",
                start,
            )
        case SocketState.NOT_A_SOCKET:
            return Item(
                HOOK,
                Status.FAIL,
                f"{fact.path} is not a socket: the daemon will not replace it, and polls only",
                f"remove {fact.path}, or set hook_socket elsewhere in {config_path}",
            )
        case _:
            return Item(
                HOOK,
                Status.WARN,
                f"cannot tell whether the daemon listens on {fact.path}: {fact.detail}",
                "run `slurm-medic doctor` as root",
            )


def judge_web(fact: WebFact, config_path: Path) -> Item:
    if not fact.configured:
        return Item(
            WEB,
            Status.WARN,
            f"not configured: {config_path} has no [web], so there is no web page (people"
            " approve and read the history with the CLI only)",
            f"set [web] socket (the proxy's or Open OnDemand's way in) or listen in"
            f" {config_path}, then start slurm-medic-web (deploy/README.md, the web page)",
        )
    start = (
        "`systemctl start slurm-medic-web` (it listens where [web] says); `journalctl -u"
        " slurm-medic-web` says why it does not"
    )
    match fact.state:
        case SocketState.ANSWERS if fact.status == 200:
            return Item(WEB, Status.OK, f"slurm-medic web answers /healthz on {fact.where}")
        case SocketState.ANSWERS:
            return Item(
                WEB,
                Status.FAIL,
                f"{fact.where} answers /healthz with HTTP {fact.status}: not slurm-medic web,"
                " or it cannot serve",
                "`journalctl -u slurm-medic-web`",
            )
        case SocketState.NOT_A_SOCKET:
            return Item(
                WEB,
                Status.FAIL,
                f"{fact.where} is not a socket: the proxy cannot reach the web page there",
                f"remove it, or set [web] socket elsewhere in {config_path}",
            )
        case SocketState.MISSING | SocketState.REFUSED | SocketState.NO_ANSWER:
            return Item(
                WEB,
                Status.FAIL,
                f"nothing answers on {fact.where} ({fact.detail or fact.state}): the proxy will"
                " find no web page",
                start,
            )
        case _:
            return Item(WEB, Status.FAIL, f"{fact.where}: {fact.detail}", start)
