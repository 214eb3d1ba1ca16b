"""Who a request is charged to: the tenant, taken only from a source Envoy vouches for.

A client must never be able to name someone else as the tenant. So the tenant is never read
from anything the client sent as is; it comes from one of (``tenant.source``):

- ``metadata``: Envoy dynamic metadata written by a filter that runs before ext_proc, e.g.
  ``envoy.filters.http.jwt_authn`` with ``payload_in_metadata``: the payload of a token whose
  signature Envoy verified. Clients cannot write dynamic metadata; only filters can. Envoy
  forwards the namespace to us (``metadata_options.forwarding_namespaces``, rendered by
  ``extproc.gateway.envoyconf``); the claim is found at ``namespace / metadata_key / claim...``.
- ``header``: a request header that Envoy itself sets. ``extproc.gateway.envoyconf`` removes every
  client copy of it before any filter runs (the connection manager's early header mutation),
  and a filter sets it from a verified source (jwt_authn ``claim_to_headers``). Names reach us
  lower-cased, so ``X-Tenant-Id`` and ``x-tenant-id`` are one header, removed together; an
  underscore variant (``x_tenant_id``) is another name, which we never read and Envoy drops
  (``headers_with_underscores_action: DROP_HEADER``) so that backends folding ``_`` into
  ``-`` never see it either. A header that still arrives twice, or as a comma-joined list,
  means the removal is not in place: we refuse to pick one and charge the default tenant.

Anything that does not name a tenant (no token, a token without the claim, a claim that is not
a string or a whole number, an empty or over-long value) is charged to ``default``. Each such
fallback is counted by why (``missing``, ``ambiguous``, ``invalid``), never with the value.

Labels stay bounded: a tenant is a metric label only when it is listed in ``known`` or is the
default; every other tenant is counted as ``other``. The name itself goes to the decision log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from extproc.config import TenantConfig, TenantSource

OTHER = "other"  # the label of every tenant not in ``known``
MAX_NAME_CHARS = 256


class Fallback(StrEnum):
    """Why a request was charged to the default tenant (a metric label)."""

    MISSING = "missing"  # no metadata / no claim / no header: an anonymous request
    AMBIGUOUS = "ambiguous"  # the header came more than once, or as a list
    INVALID = "invalid"  # the claim is not a string or whole number, is empty or too long


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str  # who is charged (decision log)
    label: str  # the metric label: ``name`` when known or the default, else ``other``
    fallback: Fallback | None = None  # set when ``name`` is the default for want of a tenant


class Tenants:
    """Resolves the tenant of one request from what Envoy forwarded (see module docstring)."""

    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        self.enabled = config.source is not TenantSource.NONE
        self._labels = frozenset(config.known) | {config.default}

    def label(self, name: str) -> str:
        return name if name in self._labels else OTHER

    def resolve(self, metadata: Mapping[str, Any],
                headers: Sequence[tuple[str, str]]) -> Tenant | None:
        """``metadata``: Envoy's ``filter_metadata`` (namespace -> Struct, which is a
        Mapping); ``headers``: (lower-case name, value) pairs as Envoy sent them."""
        source = self.config.source
        if source is TenantSource.METADATA:
            return self._tenant(_claim(metadata, self._path()))
        if source is TenantSource.HEADER:
            values = [v for k, v in headers if k == self.config.header]
            if len(values) > 1 or any("," in v for v in values):
                return self._default(Fallback.AMBIGUOUS)
            return self._tenant(values[0] if values else Fallback.MISSING)
        return None

    def _path(self) -> tuple[str, ...]:
        c = self.config
        return (c.metadata_namespace, *((c.metadata_key,) if c.metadata_key else ()), *c.claim)

    def _tenant(self, found: str | Fallback) -> Tenant:
        if isinstance(found, Fallback):
            return self._default(found)
        name = found.strip()
        if not name or len(name) > MAX_NAME_CHARS:
            return self._default(Fallback.INVALID)
        return Tenant(name, self.label(name))

    def _default(self, why: Fallback) -> Tenant:
        return Tenant(self.config.default, self.config.default, why)


def _claim(metadata: Mapping[str, Any], path: Sequence[str]) -> str | Fallback:
    """The claim at ``path`` as a string (a JSON number arrives as a float), or why there is
    none. Membership is tested before indexing: indexing a protobuf Struct creates the key."""
    node: Any = metadata
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return Fallback.MISSING
        node = node[key]
    if isinstance(node, str):
        return node
    if isinstance(node, int) and not isinstance(node, bool):
        return str(node)
    if isinstance(node, float) and node.is_integer():
        return str(int(node))
    return Fallback.INVALID
