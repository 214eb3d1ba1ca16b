"""Tenants and priorities (``extproc.gateway.tenant``, ``extproc.decision.share``): where the tenant
and a request's priority come from, and what each tenant is entitled to."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Annotated, Any, Self, cast

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator
from pydantic.dataclasses import dataclass

from extproc.config.fields import MODEL, Flag, Header, Int, Level, Named, Positive, Text
from extproc.config.rules import Problem, Rule, early, within


class TenantSource(StrEnum):
    """Where the tenant comes from (extproc.gateway.tenant): never from what the client sent."""

    NONE = "none"  # no attribution
    METADATA = "metadata"  # Envoy dynamic metadata, e.g. jwt_authn's payload_in_metadata
    HEADER = "header"  # a header Envoy removes from the client's request and sets itself


@dataclass(frozen=True, config=MODEL)
class TenantPolicy:
    """What one tenant is entitled to (extproc.decision.share): its weight in fair shares, its
    requests' priority, and optional hard caps the ledger enforces atomically."""

    weight: Positive = 1.0
    """Its weight in max-min fair shares of a contended pool."""
    priority: Level | None = None
    """Its requests' priority (unless the priority header names one)."""
    max_inflight: Annotated[Int, within(ge=1)] | None = None
    """Hard cap: the most requests it may have in flight."""
    max_outstanding_s: Positive | None = None
    """Hard cap: the most GPU-seconds of work it may owe."""


@dataclass(frozen=True, config=MODEL)
class PriorityConfig:
    """Where a request's priority comes from (extproc.decision.share), first that names one: the
    header (set by Envoy, never by the client), its tenant's, its class's, ``default``."""

    header: Header | None = None
    """A header Envoy sets (client copies are removed) that names a request's priority."""
    default: Level = 0
    """The priority of requests nothing else names."""


MAX_KNOWN_TENANTS = 100  # each known tenant is a metric label value: keep the set bounded
_TENANT_KEYS_BY_SOURCE = {
    TenantSource.METADATA: ("metadata_namespace", "metadata_key", "claim"),
    TenantSource.HEADER: ("header",),
}


def _tenant_name(v: str) -> str | None:
    if not v or len(v) > 64:
        return "must be 1 to 64 characters"
    return "is reserved for tenants not in tenant.known" if v == "other" else None


def _known(v: tuple[str, ...]) -> str | None:
    if dups := sorted({k for k in v if v.count(k) > 1}):
        return f"duplicate name {dups[0]!r}"
    if len(v) > MAX_KNOWN_TENANTS:
        return (f"at most {MAX_KNOWN_TENANTS} names, each a metric label value"
                f" (got {len(v)})")
    return None


def _tenant_names(v: Mapping[str, Any]) -> str | None:
    bad = [(name, why) for name in v if (why := _tenant_name(name)) is not None]
    return f"{bad[0][1]} (got {bad[0][0]!r})" if bad else None


TenantName = Annotated[Text, Rule(_tenant_name, minLength=1, maxLength=64)]
Claim = Annotated[
    tuple[Named, ...], BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
    Rule(lambda v: None if v else "must be a claim name or a non-empty list of names"
         " (a path into nested claims)"),
    WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1}, {
        "type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]})]


@dataclass(frozen=True, config=MODEL)
class TenantConfig:
    source: TenantSource = TenantSource.NONE
    """Where the tenant comes from: none, metadata (e.g. jwt_authn's payload) or header."""
    metadata_namespace: Named = "envoy.filters.http.jwt_authn"
    """source metadata: the namespace."""
    metadata_key: Text = "jwt_payload"
    """source metadata: the key in it (jwt_authn's payload_in_metadata); empty: none."""
    claim: Claim = ("tenant",)
    """source metadata: the claim naming the tenant (a list: a path into nested claims)."""
    header: Header = "x-tenant-id"
    """source header: a header Envoy removes from the client's request and sets itself."""
    known: Annotated[tuple[TenantName, ...], Rule(_known, quote=False, uniqueItems=True,
                                                 maxItems=MAX_KNOWN_TENANTS)] = ()
    """Tenants that are metric labels; the rest count as other."""
    default: TenantName = "anonymous"
    """Charged when no tenant is named."""
    fair_share: Flag = True
    """Share a contended pool max-min by weight between tenants."""
    tenants: Annotated[Mapping[str, TenantPolicy], Rule(_tenant_names, quote=False)] = Field(
        default_factory=dict)
    """Per tenant: weight, priority and hard caps."""
    others: TenantPolicy = Field(default_factory=TenantPolicy)
    """Every tenant not listed in tenants."""

    def policy(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.others)

    @model_validator(mode="wrap")
    @classmethod
    def _keys_of_its_source(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        """Keys of one source are errors with another (a typo'd source must not leave a
        configured claim silently unused)."""
        found = []
        if isinstance(raw, Mapping):
            source = str(raw.get("source", TenantSource.NONE.value))
            found = [Problem((key,), f"only used with tenant.source {other.value!r}"
                             f" (source is {source!r})", show=False)
                     for other, keys in _TENANT_KEYS_BY_SOURCE.items() if other != source
                     for key in keys if key in raw]
        drop = [str(p.loc[0]) for p in found]
        # duplicates among known, reported with any bad name in it (the field's own check
        # runs only once every name is good)
        known = raw.get("known") if isinstance(raw, Mapping) else None
        if isinstance(known, list) and (why := _known(tuple(map(str, known)))):
            found.append(Problem(("known",), why, show=False))
        return cast(Self, early(raw, handler, found, drop))


