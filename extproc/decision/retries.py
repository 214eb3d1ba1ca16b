"""A retry is judged by what its last attempt showed.

A client that stops waiting for an answer sends the same request again: the OpenAI SDK retries a
timed-out request twice by default, byte for byte. Priced as a fresh request (the pool's learned
lengths), the retry of an answer that cannot finish in time runs again, to the same timeout,
twice more: on an output tail (a fifth of the answers too long for their deadline even alone,
clients waiting 1.5-4x the deadline) such retries were most of what missed, and the pool's
attainment was set by how often the gateway let them in, not by its load
(``docs/admission.md``, "A retry judged by what its last attempt showed").

But the gateway saw that request run: its client left ``d`` seconds after it was admitted, so,
at the first-token time and inter-token latency the engines measured then
(``PoolLearning.engine_speed``, as for the lengths of answers nobody waited for), its answer had
about ``(d - ttft) / itl`` tokens, ``ttft`` the later of the engines' mean and the request's own
predicted first token (its prefill and the queue ahead of it). Each pool keeps, for ``KEEP_S``,
the fingerprint of each request whose client left (a digest of its body: never the body, never
logged or exported) with that count, and a request with the same fingerprint whose count is
more than its budget lets it write even alone on an idle replica is infeasible
(``extproc.decision.step``: as if it had asked vLLM's ``min_tokens`` of that many), refused or
passed as the ``infeasible`` setting says, instead of running to its client's timeout again. A
smaller count changes nothing: read at the pool's mean step it overstates what a request of a
long context, or one that waited behind a full KV cache or was preempted, wrote (on
long-context/70b-vllm, 25 of 34 such counts were above the answer's true length), and priced by
it, retries that would have fit were refused (0.80x the goodput there). Under load the same
evidence is weaker (the engines' step is slower, so a timeout's worth of it is fewer tokens),
and the retry is decided as any other. Measured only: without a fresh measurement of the
engines' speed (TGI, no engine metrics) nothing is kept.

Each gateway replica keeps its own: a retry that reaches another replica is priced fresh.
"""

from __future__ import annotations

from collections import OrderedDict

KEEP_S = 300.0  # a retry comes within its client's backoff (the SDK's: at most 8 s) or Retry-After
MOST = 10_000  # fingerprints a pool keeps at most (the oldest go first)


class Shown:
    """Fingerprints of requests whose clients left mid-answer, each with the tokens its answer
    had at least (module docstring)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[float, float]] = OrderedDict()  # -> (tokens, when)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, fingerprint: str, tokens: float, now: float) -> None:
        """The client of the request ``fingerprint`` left at ``now``, its answer at least
        ``tokens`` long (the most any of its attempts showed)."""
        earlier = self._kept.pop(fingerprint, None)
        self._kept[fingerprint] = (max(tokens, earlier[0] if earlier else 0.0), now)
        while len(self._kept) > MOST:
            self._kept.popitem(last=False)

    def forget(self, now: float) -> None:
        """Drop what is older than ``KEEP_S`` (kept in the order it came)."""
        while self._kept:
            _, (_, when) = next(iter(self._kept.items()))
            if now - when <= KEEP_S:
                return
            self._kept.popitem(last=False)

    def least(self, fingerprint: str | None) -> float:
        """The tokens a request's answer was shown to have at least (0: nothing shown)."""
        if fingerprint is None:
            return 0.0
        seen = self._kept.get(fingerprint)
        return seen[0] if seen else 0.0
