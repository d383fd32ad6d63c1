"""What a sweep does about a judged node: drain now, after the job, or record; etiquette (a
drain someone else set is never touched), the pause, dry-run and the breaker; the `medic:`
reason Slurm keeps; the return to service; and the sweep's settings."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from daemon.config import PolicySettings, Settings, SweepSettings
from daemon.evidence.nvidia_smi import MIB
from daemon.evidence.records import ComputeApp, FindingKind, GpuHealth, NodeProbe, ProbeVerdict
from daemon.fleet.findings import CORDON_FINDING, Finding, NodeJudgement, judge_node
from daemon.fleet.node_policy import (
    MAX_REASON_CHARS,
    DrainInForce,
    NodeDecision,
    NodeDecisionKind,
    NodeFacts,
    PastCheck,
    decide_node,
    resume_decision,
    slurm_reason,
)
from daemon.slurm.records import NodeBaseState, SlurmNode
from daemon.slurm.scontrol import drain_argv
from tests.test_probe import CATALOG

NOW = datetime(2026, 11, 24, 18, 0, tzinfo=UTC)
SWEEP = SweepSettings()
POLICY = PolicySettings(max_drains_per_hour=2)
REMAP_FAILURE = Finding(
    FindingKind.REMAP_FAILURE,
    ProbeVerdict.FAULTY,
    "GPU 5 (00000000:90:00.0): row remapping failure occurred",
    5,
)
REMAP_PENDING = Finding(
    FindingKind.REMAP_PENDING,
    ProbeVerdict.FAULTY,
    "GPU 2 (00000000:47:00.0): row remap pending (1 correctable, 0 uncorrectable rows): "
    "needs a GPU reset",
    2,
)
CORRECTABLE = Finding(
    FindingKind.ECC_CORRECTABLE,
    ProbeVerdict.DEGRADED,
    "GPU 2 (00000000:47:00.0): 177 correctable ECC errors since the driver loaded",
    2,
)


def judged(*findings: Finding, jobs: tuple[int, ...] = ()) -> NodeJudgement:
    health = findings[0].health if findings else ProbeVerdict.HEALTHY
    return NodeJudgement(
        node="gpu-03",
        probed_at=NOW,
        health=health,
        findings=findings,
        deciding=findings[0].text if findings else "8 GPUs of 8: healthy",
        gpus_seen=8,
        gpus_expected=8,
        running_jobs=jobs,
    )


def slurm_node(
    flags: frozenset[str] = frozenset(),
    reason: str | None = None,
    user: str | None = None,
    state: NodeBaseState = NodeBaseState.IDLE,
) -> SlurmNode:
    return SlurmNode("gpu-03", "gpu-03", state, flags, reason, user, None, "gpu:a100:8")


IN_SERVICE = slurm_node()
MEDIC_DRAINED = slurm_node(frozenset({"DRAIN"}), "medic: sweep: remap pending", "slurm")
ADMIN_DRAINED = slurm_node(frozenset({"DRAIN"}), "hw ticket 4411", "root")


def facts(
    slurm: SlurmNode | None = IN_SERVICE,
    *,
    in_force: bool = False,
    drains: int = 0,
    paused: bool = False,
) -> NodeFacts:
    return NodeFacts(slurm, in_force, drains, paused)


def decide(
    judgement: NodeJudgement,
    node_facts: NodeFacts | None = None,
    *,
    sweep: SweepSettings = SWEEP,
    policy: PolicySettings = POLICY,
) -> NodeDecision:
    return decide_node(judgement, node_facts or facts(), sweep=sweep, policy=policy)


def test_remap_failure_drains_now_with_a_medic_reason() -> None:
    decision = decide(judged(REMAP_FAILURE, jobs=(11,)))
    assert decision.kind is NodeDecisionKind.DRAIN_NOW
    assert decision.drains
    assert decision.finding is FindingKind.REMAP_FAILURE
    assert decision.reason == "remap_failure: drained now"
    assert decision.drain_reason == (
        "medic: sweep: GPU 5 (00000000:90:00.0): row remapping failure occurred"
    )


def test_pending_remap_waits_for_the_running_jobs() -> None:
    decision = decide(judged(REMAP_PENDING, CORRECTABLE, jobs=(11, 12)))
    assert decision.kind is NodeDecisionKind.DRAIN_AFTER_JOB
    assert decision.reason == "remap_pending: drained after job(s) 11, 12 end"
    assert decision.drain_reason is not None
    assert decision.drain_reason.startswith("medic: sweep: GPU 2 (00000000:47:00.0): row remap")


def test_pending_remap_on_an_idle_node_is_drained_at_once() -> None:
    decision = decide(judged(REMAP_PENDING))
    assert decision.kind is NodeDecisionKind.DRAIN_AFTER_JOB
    assert decision.reason == "remap_pending: no job runs there, drained at once"


def test_a_drain_now_finding_wins_over_an_earlier_drain_after_job_one() -> None:
    missing = Finding(FindingKind.GPU_MISSING, ProbeVerdict.FAULTY, "Slurm's gres promises 8 GPUs")
    decision = decide(judged(REMAP_PENDING, missing, jobs=(11,)))
    assert (decision.kind, decision.finding) == (
        NodeDecisionKind.DRAIN_NOW,
        FindingKind.GPU_MISSING,
    )


@pytest.mark.parametrize(
    ("judgement", "reason"),
    [
        (judged(), "healthy"),
        (judged(CORRECTABLE), "policy drains for none of: ecc_correctable"),
        (
            judged(
                Finding(FindingKind.UNREACHABLE, ProbeVerdict.UNREACHABLE, "not probed: timeout")
            ),
            "policy drains for none of: unreachable",
        ),
    ],
)
def test_what_policy_drains_for_none_of_is_recorded_only(
    judgement: NodeJudgement, reason: str
) -> None:
    decision = decide(judgement, facts(drains=0))
    assert (decision.kind, decision.reason, decision.drain_reason) == (
        NodeDecisionKind.RECORD,
        reason,
        None,
    )
    assert not decision.drains


def test_settings_decide_which_findings_drain() -> None:
    record_only = SweepSettings(drain_now=(), drain_after_job=())
    assert decide(judged(REMAP_FAILURE), sweep=record_only).kind is NodeDecisionKind.RECORD
    pending_now = SweepSettings(drain_now=(FindingKind.REMAP_PENDING,), drain_after_job=())
    decision = decide(judged(REMAP_PENDING, jobs=(11,)), sweep=pending_now)
    assert decision.kind is NodeDecisionKind.DRAIN_NOW


@pytest.mark.parametrize(
    ("slurm", "in_force"),
    [(MEDIC_DRAINED, False), (MEDIC_DRAINED, True), (None, True)],
)
def test_a_node_slurm_medic_holds_drained_is_not_drained_twice(
    slurm: SlurmNode | None, in_force: bool
) -> None:
    decision = decide(judged(REMAP_FAILURE), facts(slurm, in_force=in_force))
    assert decision.kind is NodeDecisionKind.ALREADY_DRAINED
    assert decision.finding is FindingKind.REMAP_FAILURE
    assert not decision.drains


def test_a_node_resumed_by_hand_since_medic_drained_it_is_drained_again() -> None:
    """The record still holds the drain, but Slurm shows the node taking jobs."""
    decision = decide(judged(REMAP_FAILURE), facts(IN_SERVICE, in_force=True))
    assert decision.kind is NodeDecisionKind.DRAIN_NOW


@pytest.mark.parametrize("flag", ["DRAIN", "DRAINING", "DRAINED"])
@pytest.mark.parametrize("in_force", [False, True])
def test_someone_elses_drain_is_never_touched(flag: str, in_force: bool) -> None:
    other = replace(ADMIN_DRAINED, flags=frozenset({flag}))
    for node_facts in (
        facts(other, in_force=in_force),
        facts(other, in_force=in_force, paused=True),
        facts(other, in_force=in_force, drains=5),
    ):
        decision = decide(judged(REMAP_FAILURE), node_facts)
        assert decision.kind is NodeDecisionKind.DRAINED_BY_OTHER
        assert decision.reason == "already drained by root (hw ticket 4411): left as it is"
        assert decision.drain_reason is None


def test_a_drain_with_no_user_or_reason_says_so() -> None:
    anonymous = slurm_node(frozenset({"DRAIN"}))
    decision = decide(judged(REMAP_FAILURE), facts(anonymous))
    assert decision.reason == "already drained by someone else (no reason): left as it is"


@pytest.mark.parametrize(
    ("node_facts", "policy", "reason"),
    [
        (facts(paused=True), POLICY, "slurm-medic is paused"),
        (facts(), POLICY.model_copy(update={"paused": True}), "slurm-medic is paused"),
        (facts(), POLICY.model_copy(update={"dry_run": True}), "dry-run mode: would drain_now"),
        (
            facts(drains=2),
            POLICY,
            "drain circuit breaker: 2 drain(s) in the last hour (limit 2); not draining",
        ),
        (
            facts(),
            POLICY.model_copy(update={"max_drains_per_hour": 0}),
            "drain circuit breaker: 0 drain(s) in the last hour (limit 0); not draining",
        ),
    ],
)
def test_pause_dry_run_and_the_breaker_hold_a_drain(
    node_facts: NodeFacts, policy: PolicySettings, reason: str
) -> None:
    decision = decide(judged(REMAP_FAILURE), node_facts, policy=policy)
    assert (decision.kind, decision.reason) == (NodeDecisionKind.HELD, reason)
    assert decision.finding is FindingKind.REMAP_FAILURE
    assert decision.drain_reason is None


def test_the_breaker_lets_the_last_drain_under_the_limit_through() -> None:
    assert decide(judged(REMAP_FAILURE), facts(drains=1)).kind is NodeDecisionKind.DRAIN_NOW


def test_a_hostile_process_name_cannot_break_the_slurm_reason() -> None:
    """A co-tenant's name is the node's text: escapes and line breaks never reach Slurm."""
    name = "evil\x1b[2J\r\nReason=ok\tmedic:\u2028\x00" + "x" * 300
    app = ComputeApp(gpu_uuid="GPU-3", pid=666, process_name=name, used_bytes=4096 * MIB)
    gpus = (GpuHealth(3, "GPU-3", "00000000:4E:00.0", None, None, compute_apps=(app,)),)
    probe = NodeProbe("gpu-03", NOW, ProbeVerdict.DEGRADED, ("r",), gpus)
    judgement = judge_node(
        probe, catalog=CATALOG, gpus_expected=None, running_jobs=(), cotenant_min_bytes=MIB
    )
    drain_cotenants = SweepSettings(drain_now=(FindingKind.COTENANT,))
    decision = decide(judgement, sweep=drain_cotenants)
    reason = decision.drain_reason
    assert reason is not None
    assert reason.startswith("medic: sweep: GPU 3 (00000000:4E:00.0): pid 666 (evil [2J Reason=ok")
    assert len(reason) == MAX_REASON_CHARS
    assert reason.isprintable()
    assert drain_argv("gpu-03", reason)[-1] == f"Reason={reason}"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_any_text_becomes_one_printable_medic_line(text: str) -> None:
    reason = slurm_reason(text)
    assert reason.startswith("medic:")
    assert len(reason) <= MAX_REASON_CHARS
    assert reason.isprintable()
    assert "  " not in reason


def past(*healths: ProbeVerdict) -> list[PastCheck]:
    return [PastCheck(health, f"check {n}: {health.value}") for n, health in enumerate(healths)]


AUTO = SweepSettings(auto_resume=True, resume_after_healthy=3)
REMAP_DRAIN = DrainInForce(by_daemon=True, finding=FindingKind.REMAP_PENDING.value)
H, F, D, U = (
    ProbeVerdict.HEALTHY,
    ProbeVerdict.FAULTY,
    ProbeVerdict.DEGRADED,
    ProbeVerdict.UNREACHABLE,
)


def test_a_pending_remap_drain_returns_after_enough_healthy_sweeps() -> None:
    decision = resume_decision(REMAP_DRAIN, past(F, H, H, H), MEDIC_DRAINED, sweep=AUTO)
    assert decision.kind is NodeDecisionKind.RESUME
    assert decision.reason == (
        "the pending remap was applied and 3 sweeps in a row found the node healthy"
    )


@pytest.mark.parametrize(
    ("checks", "streak", "latest"),
    [
        ((), 0, "not probed since the drain"),
        ((H, H), 2, "check 1: healthy"),
        ((H, H, F, H, H), 2, "check 4: healthy"),  # a faulty check breaks the streak
        ((H, H, H, D), 0, "check 3: degraded"),
        ((H, H, U, H), 1, "check 3: healthy"),
    ],
)
def test_the_streak_counts_healthy_sweeps_in_a_row_up_to_now(
    checks: tuple[ProbeVerdict, ...], streak: int, latest: str
) -> None:
    decision = resume_decision(REMAP_DRAIN, past(*checks), MEDIC_DRAINED, sweep=AUTO)
    assert decision.kind is NodeDecisionKind.KEEP_DRAINED
    assert decision.reason == (
        f"{streak} of 3 healthy sweeps in a row since the drain (latest: {latest})"
    )


def test_one_healthy_sweep_is_enough_when_policy_says_so() -> None:
    one = AUTO.model_copy(update={"resume_after_healthy": 1})
    assert resume_decision(REMAP_DRAIN, past(F, H), MEDIC_DRAINED, sweep=one).kind is (
        NodeDecisionKind.RESUME
    )


@pytest.mark.parametrize(
    ("drain", "slurm", "sweep", "reason"),
    [
        (
            DrainInForce(by_daemon=False, finding=CORDON_FINDING),
            MEDIC_DRAINED,
            AUTO,
            "a person's cordon: only an admin resumes it",
        ),
        (
            DrainInForce(by_daemon=True, finding=CORDON_FINDING),
            MEDIC_DRAINED,
            AUTO,
            "a person's cordon: only an admin resumes it",
        ),
        (
            DrainInForce(by_daemon=True, finding=None),
            MEDIC_DRAINED,
            AUTO,
            "drained for an incident: only a pending-remap drain returns by itself;"
            " an admin resumes it",
        ),
        (
            DrainInForce(by_daemon=True, finding=FindingKind.REMAP_FAILURE.value),
            MEDIC_DRAINED,
            AUTO,
            "drained for remap_failure: only a pending-remap drain returns by itself;"
            " an admin resumes it",
        ),
        (
            REMAP_DRAIN,
            ADMIN_DRAINED,
            AUTO,
            "Slurm no longer shows slurm-medic's drain: someone else holds the node",
        ),
        (
            REMAP_DRAIN,
            None,
            AUTO,
            "Slurm no longer shows slurm-medic's drain: someone else holds the node",
        ),
        (REMAP_DRAIN, MEDIC_DRAINED, SWEEP, "sweep.auto_resume is off: an admin resumes it"),
    ],
)
def test_only_the_daemons_pending_remap_drain_ever_returns_by_itself(
    drain: DrainInForce, slurm: SlurmNode | None, sweep: SweepSettings, reason: str
) -> None:
    decision = resume_decision(drain, past(H, H, H, H, H), slurm, sweep=sweep)
    assert (decision.kind, decision.reason) == (NodeDecisionKind.KEEP_DRAINED, reason)


def test_sweep_settings_default_to_off_and_draining_the_hard_faults() -> None:
    assert not SWEEP.enabled
    assert not SWEEP.auto_resume
    assert FindingKind.REMAP_FAILURE in SWEEP.drain_now
    assert SWEEP.drain_after_job == (FindingKind.REMAP_PENDING,)
    assert not set(SWEEP.drain_now) & {FindingKind.COTENANT, FindingKind.ECC_CORRECTABLE}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"drain_now": ["remap_pending"], "drain_after_job": ["remap_pending"]},
            "remap_pending cannot be in both drain_now and drain_after_job",
        ),
        (  # against the default drain_now
            {"drain_after_job": ["remap_failure"]},
            "remap_failure cannot be in both drain_now and drain_after_job",
        ),
        ({"drain_now": ["unreachable"]}, "an unreachable node is never drained on that alone"),
        (
            {"drain_after_job": ["unreachable"]},
            "an unreachable node is never drained on that alone",
        ),
        ({"drain_now": ["bad_karma"]}, "Input should be 'remap_failure'"),
        ({"nodes": "gpu-[01-"}, "cannot parse hostlist: a bracket is not closed"),
        ({"nodes": "gpu-[01-04],-rf"}, "'-rf' does not start like a node name"),
        ({"nodes": "n[0-99999999]"}, "names more than 65536 nodes"),
        ({"nodes": "(null)"}, "names no node"),
        ({"interval_s": 1}, "greater than or equal to 5"),
        ({"resume_after_healthy": 0}, "greater than or equal to 1"),
        ({"drain_everything": True}, "Extra inputs are not permitted"),
    ],
)
def test_sweep_settings_refuse_what_cannot_be_meant(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        SweepSettings.model_validate(fields)


def test_sweep_settings_take_a_hostlist_and_moved_kinds() -> None:
    sweep = SweepSettings.model_validate(
        {
            "nodes": "gpu-[01-04]",
            "drain_now": ["remap_failure", "remap_pending"],
            "drain_after_job": ["gpu_missing"],
        }
    )
    assert sweep.nodes == "gpu-[01-04]"
    assert sweep.drain_now == (FindingKind.REMAP_FAILURE, FindingKind.REMAP_PENDING)
    assert sweep.drain_after_job == (FindingKind.GPU_MISSING,)


def test_an_enabled_sweep_needs_the_probe() -> None:
    with pytest.raises(ValidationError, match=r"sweep\.enabled needs the \[probe\] section"):
        Settings(sweep=SweepSettings(enabled=True))
