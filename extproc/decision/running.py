"""One admitted request's record: made once, where its admission is decided, read after it.

``extproc.decision.step.running_of`` makes it from the ``Admission``; the gate's ``Ticket`` and the
simulator's ``Attempt`` carry it to the stream's end, and the pool's learning reads it twice
(``PoolLearning.admitted`` when it runs, ``PoolLearning.settled`` when its stream ends) and
keeps it until its deadline resolves it. Nobody copies its fields: what the decision predicted
and what the request is travel together. A leaf: it imports nothing of the house.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Running:
    """An admitted request, as its decision saw it; ``missed`` is the one thing set later."""

    service_class: str
    started: float  # when it was admitted (the clock its stream's duration is read on)
    deadline_s: float = math.inf  # its budget from ``started`` (a held request's is what was left)
    batch: bool = False  # its class is a batch class
    groups: tuple[str, ...] = ()  # the ledger groups it counts in (priority, tenant)
    expected_s: float = 0.0  # its predicted time in flight (0: no prediction)
    prefill_rate: float = 0.0  # the fleet's prompt tokens a second when it was admitted
    ttft_ms: float = 0.0  # its decision's predicted first token
    step_ms: float = 0.0  # ... and decode step (0: no prediction, nothing to learn)
    chance: float | None = None  # predicted chance it misses (None: not a step decision)
    unavoidable: float = 0.0  # chance it misses even alone
    prompt_tokens: int = 0  # prefilled for sure once its stream has ended
    missed: bool = False  # still running at its deadline: resolved as a miss
    at_ms: float = 0.0  # work per replica outstanding at its admission, its own included ...
    level_ms: float = -1.0  # ... the measured level then (< 0: not measured, ``decision.level``)
    own_ms: float = 0.0  # ... its own work per replica ...
    alone: bool = False  # ... and whether a replica had nothing to do
    measured: bool = False  # admitted by the measured level against the model's prediction
    share: float = 1.0  # this gateway's share of the pool's requests in flight at admission
    streaming: bool = True  # its client leaving aborts it at the engine (``Ask.streaming``)
    fingerprint: str | None = field(default=None, repr=False)  # ``Ask.fingerprint``
