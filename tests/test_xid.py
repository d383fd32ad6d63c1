"""The XID catalog data and the operator's overrides."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from pydantic import ValidationError

from daemon.evidence.records import XidPolicy
from daemon.evidence.xid import XidCatalogError, XidOverride, load_catalog, parse_catalog


def test_catalog_cites_nvidia_and_a_date() -> None:
    catalog = load_catalog()
    assert (
        catalog.source_url == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
    )
    assert catalog.retrieved == "2026-11-22"
    assert len(catalog.entries) == 172


@pytest.mark.parametrize("code", [48, 63, 64, 79, 92, 94, 95, 119, 120])
def test_runbook_hardware_codes(code: int) -> None:
    assert load_catalog().entry(code).policy is XidPolicy.HARDWARE


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_codes(code: int) -> None:
    assert load_catalog().entry(code).policy is XidPolicy.APPLICATION


def test_entry_carries_nvidia_meaning_and_actions() -> None:
    entry = load_catalog().entry(79)
    assert entry.mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert entry.meaning == "GPU has fallen off the bus"
    assert (entry.immediate_action, entry.investigatory_action) == ("RESTART_BM", "CONTACT_SUPPORT")
    assert entry.count_threshold == 1


def test_unknown_code_is_a_driver_event_not_in_catalog() -> None:
    entry = load_catalog().entry(500)
    assert (entry.policy, entry.in_catalog) == (XidPolicy.DRIVER, False)
    assert "not in NVIDIA's catalog" in entry.meaning


def test_override_changes_policy_and_threshold_only_for_that_code() -> None:
    catalog = load_catalog({13: XidOverride(policy=XidPolicy.HARDWARE, count_threshold=5)})
    assert (catalog.entry(13).policy, catalog.entry(13).count_threshold) == (XidPolicy.HARDWARE, 5)
    assert catalog.entry(13).meaning == "Graphics Engine Exception"
    assert catalog.entry(31).policy is XidPolicy.APPLICATION


def test_override_may_add_a_new_code_with_a_policy() -> None:
    catalog = load_catalog({300: XidOverride(policy=XidPolicy.HARDWARE)})
    assert catalog.entry(300).policy is XidPolicy.HARDWARE


def test_override_of_a_new_code_without_policy_is_refused() -> None:
    with pytest.raises(XidCatalogError, match="XID 300 is not in the catalog"):
        load_catalog({300: XidOverride(count_threshold=2)})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"policy": "drain"}, "policy"),
        ({"count_threshold": 0}, "greater than or equal to 1"),
        ({"count_threshold": "many"}, "valid integer"),
        ({}, "must set policy, count_threshold or both"),
        ({"policy": "hardware", "colour": "red"}, "Extra inputs"),
    ],
)
def test_bad_overrides_are_clear_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        XidOverride.model_validate(raw)


def test_packaged_json_is_well_formed_and_every_entry_valid() -> None:
    text = resources.files("daemon.evidence").joinpath("xid_catalog.json").read_text()
    document = json.loads(text)
    assert set(document["source"]) >= {"url", "retrieved"}
    assert parse_catalog(text).entries.keys() == set(range(1, 173))


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda d: d["entries"][0].update(policy="drain"), "unknown policy 'drain'"),
        (lambda d: d["entries"][0].update(count_threshold=0), "count_threshold"),
        (lambda d: d["entries"].append(dict(d["entries"][0])), "lists code 1 twice"),
        (lambda d: d.pop("source"), "must cite its source"),
    ],
)
def test_broken_catalog_is_refused(mutation: object, message: str) -> None:
    text = resources.files("daemon.evidence").joinpath("xid_catalog.json").read_text()
    document = json.loads(text)
    mutation(document)  # type: ignore[operator]
    with pytest.raises(XidCatalogError, match=message):
        parse_catalog(json.dumps(document))


def test_catalog_that_is_not_json_is_refused() -> None:
    with pytest.raises(XidCatalogError, match="not JSON"):
        parse_catalog("\x00\x01")
