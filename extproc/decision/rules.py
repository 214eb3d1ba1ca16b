"""What the decision core reads of the configuration: a small frozen value, built once.

The admission step (``extproc.decision.step``), what an admission must leave to others
(``extproc.decision.contention``) and the pool's learning (``extproc.decision.learning``) read these
rules, never ``Config``: the gate and the simulator build them once from the configuration they were
given (``Rules.of``), so the core sees the service classes, the infeasible policy, the lease's
grace, the tenants' and priorities' rules and whether refused requests are held, and nothing of the
listeners, the ledger's connection, tracing or the routes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.config import ClassPolicy, Config, Infeasible, TenantConfig


@dataclass(frozen=True)
class Rules:
    """The configuration's rules for deciding (module docstring)."""

    classes: Mapping[str, ClassPolicy]  # the service classes, by name
    infeasible: Infeasible  # a request that misses even alone: passed, or a 400
    lease_grace_ms: float  # an admitted request's ledger lease past its predicted end
    tenant: TenantConfig  # tenants' weights, priorities, caps and fair share
    default_priority: int  # the priority of requests nothing else names
    holds: bool  # what fits after a wait is held (``extproc.decision.defer``)

    @classmethod
    def of(cls, config: Config) -> Rules:
        return cls(config.classes, config.infeasible, config.ledger.lease_grace_ms,
                   config.tenant, config.priority.default, config.defer.enabled)

    def interactive(self, service_class: str) -> bool:
        """Whether ``service_class`` is a configured class without ``batch``."""
        cls = self.classes.get(service_class)
        return cls is not None and not cls.batch
