"""What users wrote (job names, log lines, reasons) reaches a terminal inert: escape sequences,
bidi overrides and zero-width characters are shown as escapes by `show`, `history`, `status`
and `nodes`, and `--json` stays JSON that reads back the same values."""

from __future__ import annotations

import json
import unicodedata
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.cli import main
from daemon.commands.terminal import printable, printable_document, printable_json
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence, LogFindings, OomFamily, OomReport
from daemon.slurm.records import SlurmJob
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.factories import ended_job
from tests.fixes import seeded_fix

# The record's commands as root, who may read every run: the `root` mark.
pytestmark = pytest.mark.root

# Written out here rather than taken from the module, so the test checks the module.
SPOOFING = frozenset("\u061c\u200b\u200c\u200d\u200e\u200f\u2028\u2029\u2060\ufeff") | frozenset(
    chr(code) for code in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)
JOB_NAME = "train\x1b]0;root@login\x07\u202egnp.exe"
LOG_NOTE = "rank 3 said \x1b[2J\x1b[Hall clear\r"
OOM_MESSAGE = "CUDA out of memory.\x9b31m Tried to allocate 2.00 GiB\u2066"
DRAIN_REASON = "medic: XID 79\x1b[8m hidden\x7f"
RATIONALE = "micro-batch 8 -> 4 \u200dkept"


def unsafe(text: str) -> set[str]:
    """Characters a terminal would act on, found without the module's own pattern."""
    controls = {ch for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\n\t"}
    return controls | (set(text) & SPOOFING)


# ---------------------------------------------------------------- the function


def test_controls_become_visible_escapes_and_text_stays() -> None:
    assert printable("a\x1b[31mred\x07") == "a\\x1b[31mred\\x07"
    assert printable("\x9b2J\x7f\x00") == "\\x9b2J\\x7f\\x00"
    assert printable("evil\u202etxt.exe\u2066\u200d") == "evil\\u202etxt.exe\\u2066\\u200d"
    assert printable("over\rwrite") == "over\\x0dwrite"
    assert printable("two\nlines\tand a tab, é, 日本, emoji 🙂") == (
        "two\nlines\tand a tab, é, 日本, emoji 🙂"
    )


@settings(max_examples=300, deadline=1000)
@given(st.text(max_size=200))
def test_printable_leaves_nothing_a_terminal_acts_on(text: str) -> None:
    shown = printable(text)
    assert unsafe(shown) == set()
    assert printable(shown) == shown  # applying it twice changes nothing
    if not unsafe(text):
        assert shown == text


@settings(max_examples=200, deadline=1000)
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=100), max_size=5))
def test_printable_json_reads_back_the_same_values(document: dict[str, str]) -> None:
    text = printable_json(document)
    assert unsafe(text) == set()
    assert json.loads(text) == document


def test_printable_document_reaches_every_string() -> None:
    document = {"a\x1b": ["x\u202e", ("y\x07", 3)], "n": None, "k": {"deep": "\x9b"}}
    assert printable_document(document) == {
        "a\\x1b": ["x\\u202e", ["y\\x07", 3]],
        "n": None,
        "k": {"deep": "\\x9b"},
    }


# ---------------------------------------------------------------- the commands


def _job() -> SlurmJob:
    end = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    return ended_job(
        7001,
        name=JOB_NAME,
        end=end,
        work_dir="/home/alice",
        stdout_path="/home/alice/run.out",
    )


@pytest.fixture
def hostile_config(tmp_path: Path) -> Path:
    """A record whose job name, log findings, OOM message, rationale and drain reason carry
    escape sequences and spoofing characters; the config that points at it."""
    url = sqlite_url(tmp_path / "medic.db")
    engine = make_engine(StoreSettings(url=url))
    upgrade(engine)
    oom = OomReport(family=OomFamily.TORCH_ALLOCATOR, message=OOM_MESSAGE)
    with make_session_factory(engine)() as session:
        lineage = repo.create_lineage(session, name=JOB_NAME, owner="alice", template="t")
        repo.record_job(session, job=_job(), lineage_id=lineage.id, attempt=1)
        incident = repo.record_incident(
            session,
            slurm_job_id=7001,
            evidence=Evidence(
                job=_job(),
                log=LogFindings(oom=oom, notes=(LOG_NOTE,), root_failure_line=LOG_NOTE),
            ),
            diagnosis=Diagnosis(
                kind=FailureKind.TRUE_OOM,
                confidence=Confidence.HIGH,
                reasons=(LOG_NOTE,),
                oom=oom,
            ),
        )
        repo.propose(
            session,
            incident_id=incident.id,
            fix=seeded_fix(),
            rationale=RATIONALE,
            cost=1.0,
            changes_science=False,
            actor=repo.Actor.daemon(),
        )
        control.record_node_event(
            session,
            node="gpu-01",
            kind=NodeEventKind.DRAIN,
            by_medic=True,
            reason=DRAIN_REASON,
            incident_id=incident.id,
        )
        session.commit()
    engine.dispose()
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\nurl = "{url}"\n')
    return config


COMMANDS = [["show", "L1"], ["show", "7001"], ["history"], ["status"], ["nodes"]]
# What each command shows of the hostile text (history's columns hold none of it).
SHOWN = {"show": JOB_NAME, "status": RATIONALE, "nodes": DRAIN_REASON}


@pytest.mark.parametrize("args", COMMANDS)
def test_human_output_shows_user_text_inert(hostile_config: Path, args: list[str]) -> None:
    result = CliRunner().invoke(
        main, [*args, "--config", str(hostile_config)], env={"SUDO_UID": "", "COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    assert unsafe(result.output) == set()
    if args[0] in SHOWN:  # shown escaped, not dropped: a person sees what was there
        assert printable(SHOWN[args[0]]) in result.output


def test_show_prints_each_kind_of_user_text_escaped(hostile_config: Path) -> None:
    result = CliRunner().invoke(
        main, ["show", "L1", "--config", str(hostile_config)], env={"COLUMNS": "400"}
    )
    for original in (JOB_NAME, LOG_NOTE, OOM_MESSAGE, DRAIN_REASON, RATIONALE):
        assert printable(original) in result.output


def _strings(value: object) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_strings(item) for item in value.values()))
    if isinstance(value, list):
        return set().union(*(_strings(item) for item in value))
    return set()


@pytest.mark.parametrize("args", COMMANDS)
def test_json_output_is_inert_and_reads_back_the_record(
    hostile_config: Path, args: list[str]
) -> None:
    result = CliRunner().invoke(
        main, [*args, "--json", "--config", str(hostile_config)], env={"SUDO_UID": ""}
    )
    assert result.exit_code == 0, result.output
    assert unsafe(result.output) == set()
    if args[0] in SHOWN:  # a script reads the record's own text, unescaped
        assert SHOWN[args[0]] in _strings(json.loads(result.output))
