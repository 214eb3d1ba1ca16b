"""Clients: how a job's attempts come and go.

A client sends a job; each send is an ``Attempt`` (the gateway sees attempts, not jobs). The
client behaves like the official OpenAI SDK (``ClientModel`` defaults):

- a 429 is retried after its ``Retry-After`` when that is at most ``honor_retry_after_s``,
  else after the SDK's own backoff, up to ``max_retries`` retries; then the job is shed;
- a client waits ``timeout_s`` for its answer, then gives up on the attempt (the stream is
  cancelled: the gateway releases its ledger entry; the engine drops the sequence only when
  the scenario says engines see disconnects) and, with ``retry_on_timeout``, retries;
- the SDK's backoff: ``min(initial x 2^n, max) x (1 - 0.25 x U)`` for the n-th retry.

A job is *served* when one of its attempts completes while its client still waits; it is
*good* when that completion also meets the attempt's deadline (and time-to-first-token
objective, for classes that have one). See ``docs/simulator.md`` for the exact definitions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from extproc.fleet.engine import Sequence

if TYPE_CHECKING:
    from extproc.decision.running import Running
    from extproc.sim.workload import Job


class Host(Protocol):
    """Where an attempt runs (``extproc.sim.engine.Replica``), as far as its client needs:
    dropping it. The engine imports this module, never the other way round."""

    def abort(self, a: Attempt, now: float) -> bool: ...


@dataclass(frozen=True)
class ClientModel:
    timeout_s: float = 600.0
    max_retries: int = 2
    retry_on_timeout: bool = True
    honor_retry_after_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        base = min(self.backoff_initial_s * 2.0 ** retry, self.backoff_max_s)
        return base * (1.0 - 0.25 * rng.random())

    def after_429_s(self, retry_after_s: float, retry: int, rng: random.Random) -> float:
        if 0 < retry_after_s <= self.honor_retry_after_s:
            return retry_after_s
        return self.backoff_s(retry, rng)


class Attempt(Sequence):
    """One send of a job: the gateway's request and, once admitted, the engine's sequence
    (``extproc.fleet.engine.Sequence``: prompt, output, KV blocks, progress)."""

    __slots__ = (
        "abandoned",
        "aborted",
        "arrival",
        "ask",
        "batch",
        "deadline_s",
        "finished_at",
        "first_token_at",
        "gpu_s",
        "groups",
        "job",
        "key",
        "max_output_tokens",
        "number",
        "outcome",
        "queued_at",
        "record",
        "released",
        "replica",
        "started_at",
        "ttft_objective_s",
    )

    def __init__(self, job: Job, number: int, arrival: float, key: str, output_tokens: int,
                 max_output_tokens: int, deadline_s: float, ttft_objective_s: float | None
                 ) -> None:
        super().__init__(job.prompt_tokens, output_tokens, job.prefix_key, job.prefix_tokens)
        self.job = job
        self.number = number  # 0 for the first send, then 1, 2, ... for retries
        self.arrival = arrival
        self.max_output_tokens = max_output_tokens  # max_tokens (or the default): the most
        self.deadline_s = deadline_s
        self.ttft_objective_s = ttft_objective_s
        self.key = key
        self.outcome = ""
        self.replica: Host | None = None  # the replica it was sent to
        self.queued_at = -1.0
        self.started_at = -1.0
        self.first_token_at = -1.0
        self.finished_at = -1.0
        self.gpu_s = 0.0
        self.aborted = False  # the engine was told to drop it
        self.abandoned = False  # its client stopped waiting
        self.released = False
        self.batch = False  # its class is a batch class
        self.record: Running | None = None  # once admitted (``extproc.decision.running``)
        self.groups: tuple[str, ...] = ()  # its ledger groups (priority, tenant) once admitted
        self.ask: Any = None  # what the gateway's step is asked (``extproc.decision.step.Ask``)

    @property
    def good(self) -> bool:
        """Completed, to a waiting client, within its deadline and TTFT objective."""
        if self.finished_at < 0.0 or self.abandoned:
            return False
        if self.finished_at - self.arrival > self.deadline_s:
            return False
        ttft = self.ttft_objective_s
        return ttft is None or self.first_token_at - self.arrival <= ttft
