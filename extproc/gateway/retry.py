"""When a rejected client should come back: pure arithmetic, shared by the server's answers
(``extproc.gateway.responses``) and the simulator, which must not import Envoy's messages."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.config import RetryAfter


def retry_delay_ms(retry_after_ms: float | None, rules: RetryAfter, rng: random.Random) -> int:
    """When a rejected client should come back, in whole milliseconds:

        ceil(min(max_s x 1000, max(hint, min_s x 1000) x (1 + U x jitter))),  U in [0, 1)

    ``hint`` is the decision's ``retry_after_ms`` (when the request would fit; none: 0). The floor
    is applied before the spread, so requests rejected together with a small hint (or none) still
    return at different times, up to ``jitter x min_s`` apart; the cap comes last, and also takes
    a hint that is not a finite number.
    """
    floor_ms = rules.min_s * 1000.0
    base_ms = max(retry_after_ms or 0.0, floor_ms)
    spread_ms = base_ms * (1.0 + rng.random() * rules.jitter)
    return math.ceil(min(rules.max_s * 1000.0, spread_ms))
