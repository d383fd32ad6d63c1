"""The XID catalog as data: NVIDIA's meaning and actions per code, and our policy per code.

The catalog ships as `xid_catalog.json` (generated from NVIDIA's published catalog, with
its source and date in the header). Operators override any entry from the config; the
overrides are validated when the settings load, so a typo stops start-up instead of
silently changing which nodes get drained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field, model_validator

from daemon.evidence.records import XidPolicy

CATALOG_RESOURCE = "xid_catalog.json"
MAX_XID_CODE = 1023
MAX_COUNT_THRESHOLD = 10_000


class XidCatalogError(ValueError):
    """The catalog file or an override is malformed; the message says which entry and why.

    The only error `parse_catalog` raises, whatever the text."""


@dataclass(frozen=True)
class XidCatalogEntry:
    """One XID code: what NVIDIA says it means and what to do, and what it means for us."""

    code: int
    mnemonic: str
    meaning: str
    immediate_action: str | None
    investigatory_action: str | None
    policy: XidPolicy
    count_threshold: int
    in_catalog: bool = True


class XidOverride(BaseModel):
    """An operator's change to one code's policy or threshold (either or both)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: XidPolicy | None = None
    count_threshold: int | None = Field(default=None, ge=1, le=MAX_COUNT_THRESHOLD)

    @model_validator(mode="after")
    def _changes_something(self) -> XidOverride:
        if self.policy is None and self.count_threshold is None:
            raise ValueError("an XID override must set policy, count_threshold or both")
        return self


@dataclass(frozen=True)
class XidCatalog:
    """Every known code, keyed by number; codes newer than the catalog still get an entry."""

    entries: Mapping[int, XidCatalogEntry]
    source_url: str
    retrieved: str

    def entry(self, code: int) -> XidCatalogEntry:
        """The entry for `code`; an unknown code counts as a driver event until told otherwise."""
        known = self.entries.get(code)
        if known is not None:
            return known
        return XidCatalogEntry(
            code=code,
            mnemonic="UNKNOWN",
            meaning=f"XID {code} is not in NVIDIA's catalog of {self.retrieved}",
            immediate_action=None,
            investigatory_action=None,
            policy=XidPolicy.DRIVER,
            count_threshold=1,
            in_catalog=False,
        )

    def with_overrides(self, overrides: Mapping[int, XidOverride]) -> XidCatalog:
        """A copy with the operator's overrides applied; a new code must name its policy."""
        merged = dict(self.entries)
        for code, override in sorted(overrides.items()):
            _check_code(code)
            base = merged.get(code)
            if base is None:
                if override.policy is None:
                    raise XidCatalogError(
                        f"XID {code} is not in the catalog: its override must set a policy"
                    )
                base = replace(self.entry(code), in_catalog=False)
            merged[code] = replace(
                base,
                policy=override.policy or base.policy,
                count_threshold=override.count_threshold or base.count_threshold,
            )
        return XidCatalog(
            entries=MappingProxyType(merged), source_url=self.source_url, retrieved=self.retrieved
        )


def parse_catalog(text: str) -> XidCatalog:
    """Read the catalog JSON; every entry is checked, so a hand edit cannot load half-broken."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        # JSONDecodeError, an integer of more than 4300 digits, or nesting past the stack.
        raise XidCatalogError(f"XID catalog is not JSON: {str(error)[:200]}") from error
    if not isinstance(document, dict) or not isinstance(document.get("entries"), list):
        raise XidCatalogError("XID catalog must be an object with an 'entries' list")
    source = document.get("source")
    if not isinstance(source, dict) or not source.get("url") or not source.get("retrieved"):
        raise XidCatalogError("XID catalog must cite its source: source.url and source.retrieved")
    entries: dict[int, XidCatalogEntry] = {}
    for position, raw in enumerate(document["entries"]):
        entry = _parse_entry(raw, position)
        if entry.code in entries:
            raise XidCatalogError(f"XID catalog lists code {entry.code} twice")
        entries[entry.code] = entry
    return XidCatalog(
        entries=MappingProxyType(entries),
        source_url=str(source["url"]),
        retrieved=str(source["retrieved"]),
    )


def load_catalog(overrides: Mapping[int, XidOverride] | None = None) -> XidCatalog:
    """The packaged catalog with the operator's overrides applied."""
    text = resources.files("daemon.evidence").joinpath(CATALOG_RESOURCE).read_text("utf-8")
    catalog = parse_catalog(text)
    return catalog.with_overrides(overrides) if overrides else catalog


def _parse_entry(raw: object, position: int) -> XidCatalogEntry:
    if not isinstance(raw, dict):
        raise XidCatalogError(f"XID catalog entry #{position} is not an object")
    code = raw.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        raise XidCatalogError(f"XID catalog entry #{position} has no integer code")
    _check_code(code)
    try:
        policy = XidPolicy(str(raw.get("policy")))
    except ValueError:
        names = ", ".join(p.value for p in XidPolicy)
        raise XidCatalogError(
            f"XID {code}: unknown policy {repr(raw.get('policy'))[:80]} (expected one of {names})"
        ) from None
    threshold = raw.get("count_threshold")
    if (
        not isinstance(threshold, int)
        or isinstance(threshold, bool)
        or not 1 <= threshold <= MAX_COUNT_THRESHOLD
    ):
        raise XidCatalogError(
            f"XID {code}: count_threshold must be an integer in 1..{MAX_COUNT_THRESHOLD}"
        )
    return XidCatalogEntry(
        code=code,
        mnemonic=str(raw.get("mnemonic") or ""),
        meaning=str(raw.get("meaning") or ""),
        immediate_action=_optional_text(raw.get("immediate_action")),
        investigatory_action=_optional_text(raw.get("investigatory_action")),
        policy=policy,
        count_threshold=threshold,
    )


def _check_code(code: int) -> None:
    if not 1 <= code <= MAX_XID_CODE:
        raise XidCatalogError(f"XID code {code} is out of range 1..{MAX_XID_CODE}")


def _optional_text(value: object) -> str | None:
    return str(value) if value not in (None, "") else None
