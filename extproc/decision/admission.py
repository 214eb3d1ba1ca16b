"""The admission decision: a pure function of cost, ledger snapshot, capacity, policy and now.

No I/O, no clock reads, no logging: the gateway and the simulator call the very same
``decide`` (through the admission step, ``extproc.decision.step``), so what the simulator proves is
what production does.

The model, per pool of ``R`` ready replicas, each the engine of ``extproc.fleet.engine`` (a decode
step of ``b`` sequences at context ``c`` takes ``itl(b, c)``; a prompt is prefilled in chunks
of the step's token budget). A request has ``P`` prompt tokens and decodes ``s`` sequences
(``n`` choices, prompts, ``best_of``: one, mostly), each up to ``M`` tokens (``max_tokens``);
what each will generate is unknown, so it carries two lengths from the pool's learned
output-length distribution (``extproc.decision.lengths``):

    typical   o = E[min(output, M)]                a sequence's expected length: what each
                                                   is charged
    promised  L = min(M, Q(q ** (1 / s)))          the quantile ``q`` it is promised on (of
                                                   the longest of its ``s``); ``q`` is held
                                                   by feedback (``extproc.decision.learning``)

and the pool's traffic has a mean prompt ``P̄`` and mean output ``Ō`` (context ``C̄ = P̄ + Ō /
2``). With ``n`` requests in flight, ``W`` ms of work outstanding and ``K`` KV tokens held
(each entry's footprint ``Cost.kv``: the ledger's snapshot):

    slots    S = min(max_num_seqs, kv_tokens / f)           a replica's batch: its sequence
                                                          limit, or what its KV cache holds
                                                          of sequences of the mean footprint
                                                          ``f = (K + kv) / (n + s)`` of
                                                          those in flight and this one's;
                                                          but where the engines report
                                                          their caches (below), at least
               >= (n + s) / R   if it fits the fullest   all of them, spread over the
                                                          replicas, or none, by what they
               = 0              if its prompt does not   report free (its place then at
                                fit even the emptiest    least 1: it waits for memory)
    position p = n + min(s, S) - R x S                     its place in the engines' queues
    batch    b = min(S, (p + R x S) / R)                   running sequences per replica
    step       = itl(b, C̄) + (b / Ō) x prefill(P̄)          a decode step, plus the prefill of
                                                          the requests that keep the batch
                                                          full (one in Ō sequences is new)
    wait       = 0                        if p <= 0       (a slot is free: it starts now)
               = q_w(ceil(p / R)) x W / n otherwise
               + (U / R) / (budget - b) x chunk_step       the prompts admitted before it and
                                                          not prefilled yet, ``U`` tokens,
                                                          go first: a step prefills the
                                                          token budget less its decodes
    chunk_step = a step of the token budget:              the running batch's decodes read
                 b decodes at context C̄ and a            their context, and each chunk
                 chunk attending to P̄ / 2                attends to the prompt before it
    ttft       = wait + prefill(P) + chunks(P) x itl(b, C̄) its prompt, in chunks beside the
                                                          decodes
    completion = ttft + ceil(s / S) x L x step             its sequences side by side, in
                                                          rounds of a replica's batch

It admits when ``completion <= deadline x safety`` and, for classes with a time-to-first-
token objective, ``ttft <= ttft_objective x safety``.

Why it looks like this. A full replica frees a slot every ``W / n`` of GPU time on average
(the ledger charges each request its GPU share in a full batch: its prefill plus ``o x
itl(S, C̄) / S``), so a request ``k``-th in its replica's queue starts with the ``k``-th
release. Releases are irregular, so the wait is the ``wait_quantile`` of the time to the
``k``-th event of a Poisson stream (``release_quantile``), not its mean. A decode step grows
with the batch and the context its sequences read (the engine's roofline), and in a busy
replica every step also carries a share of the prefill of the sequences joining: in steady
state one sequence in ``Ō`` finishes each step and its successor's prompt is prefilled.
Prompts arrive in bursts: a crowd's prompts are prefilled in FCFS chunks of the token budget,
so a request admitted right after them waits for theirs before its own; the gateway keeps
that backlog (``U``: prompt tokens admitted, drained at the fleet's prefill rate;
``extproc.decision.learning.Backlog``), or first tokens in a burst come late.
The KV cache bounds the batch before ``max_num_seqs`` does when contexts are long: a replica
holds ``kv_tokens / f`` sequences, and past that vLLM preempts (by recomputation: work lost). A
sequence's footprint is its prompt and the larger of its typical output and the mean output a
request *in flight* holds, ``E[o^2] / 2E[o]`` (``Cost.kv``): requests in flight are the long
ones more often than arrivals are, so with heavy-tailed outputs (most answers a few tokens, one
in five a thousand) the batch holds far more than arrivals' mean suggests. Counting what the
ledger holds, not the mix, matters when prompts are heavy-tailed: a few 100k-token documents
fill a replica that a mean would call a quarter full. And a request never waits in an engine's
queue for memory (``KV_CACHE``): vLLM takes a waiting request in as soon as its first chunk's
blocks are free, and when the batch's sequences then grow into the blocks it took, it preempts
the newest and recomputes it later; a queue that waits for memory makes the engine thrash.
Queueing is for slots (``max_num_seqs``), where a waiting request holds nothing.
But a mean says how many requests of the mean's size fit, not whether this one does: beside
35,000-token documents a replica holds five whole slots of the mean, and a 1,500-token prompt
would wait for memory while a third of the cache is free; and the ledger's footprints are
estimates (a shared prefix the engine caches once, answers shorter or longer than held).
Where the engines' KV usage is scraped (``Capacity.reported``: the replica an endpoint picker
named, else the fullest and the emptiest fresh replica), the cache they report free decides,
less what the requests running or waiting there will still write (each what a request in
flight holds of its answer, as ``Cost.kv`` counts it) and the prompts admitted but not
prefilled yet (``U``): a request whose own footprint fits that
on the fullest replica, and fits a replica's share of what the ledger leaves free
(``kv_tokens - K / R``), has the slots it needs; one whose prompt does not fit even the
emptiest replica's free cache after ``U`` waits for memory (``Capacity.fits_reported``): vLLM
needs a prompt's blocks to prefill it, while an answer's grow as it is written, and a batch
that outgrows its cache preempts (work redone) rather than refuses. Between the two, or
unscraped, the mean's slots stand.

A request of ``s`` sequences (``Cost.sequences``) is ``s`` requests to the engine but for its
prompt: vLLM prefills it once and forks it, and each choice then takes a slot, holds its
output in the KV cache and is decoded step by step beside the others on the same replica. So
its charge is one prefill and ``s`` decodes, its footprint one prompt and ``s`` outputs, it
needs ``s`` slots of one replica (its batch at most; more run in rounds), and it ends with
the longest of its ``s``. Priced as one answer, ``n = 64`` took a full pool's last slot at one
answer's charge. The ledger counts it as one entry in flight (its work and KV in full): the
decisions after it see the slots it takes as one.

Charge the typical, promise a quantile. The fleet is charged what requests will probably cost
(charging ``max_tokens`` in full makes a busy fleet look several times busier than it is); a
request's own completion uses the promised length. A per-request promise at a high quantile
is stricter than the population target (99% of admitted requests within their deadline):
the promise quantile is therefore not a constant but held by feedback on measured attainment
(``extproc.decision.learning.Promise``), between ``Q(0.5)`` and ``Q(0.995)``.

Feasibility is judged on the typical length: a request whose typical completion misses its
deadline even on an idle replica (``b = 1``, no wait) is ``INFEASIBLE``: a 429 would invite
retries that can never succeed. What happens to it is the step's business
(``extproc.decision.step``): it never waits in a queue that admitted requests wait in. A promise
longer than what the request could generate alone within its budget is capped at that length:
such a request is admitted while its replica is (nearly) idle and refused when it is busy,
never refused by an idle fleet (a fresh pool whose prior expects long answers would otherwise
refuse everything, and learn nothing).

Batch classes (``Policy.batch``) take only capacity the interactive classes do not need:
``Capacity.headroom`` slots (from the interactive classes' measured demand,
``extproc.decision.learning.Demand``) are held back, and a batch request is admitted only into a
free slot beyond them (it never queues in front of an interactive request in the engines' FIFO).

An admission carries ``ceiling_ms``, the threshold for the ledger's atomic check-and-record
(a shared ledger may have changed since the snapshot): the most outstanding work, this request
included, under which it still fits. Requests admitted ahead of it meanwhile add about their
charge each to ``W`` and ``1 / R`` of it each to its wait, so with ``slack = min(budget -
completion, ttft_budget - ttft)``

    ceiling    = W + charge + R x slack

and ``max_inflight``, the most requests in flight, this one included, under which it still
fits: each request admitted meanwhile pushes it one place back, the free slots cost nothing,
and past them each place a replica's queue deepens costs a release, until the added wait
eats the slack (none past the slots when the batch is bound by KV memory). The work ceiling
alone let two gateways both take the last free slot: at a free slot the slack is counted in
milliseconds of work, and one more request's work fits in it though its slot does not. An
unchanged ledger satisfies both.

A rejection says when the request would fit: the wait shrinks by one millisecond per
millisecond while nothing new is admitted, so ``retry_after = completion - budget`` (or the
TTFT excess, whichever is larger); when the wait is already zero the excess comes from the
batch being full, and the hint is at least the time a replica takes to free a slot.

Length: past the house's ~400 lines because a quarter is this docstring, the model the code
follows line by line; the code is the result types and one function, ``decide``, which the
gateway and the simulator share and which reads best whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from statistics import NormalDist

from extproc.fleet.engine import EngineModel


class Outcome(StrEnum):
    """Low-cardinality result of one request's admission: a metric label and span attribute."""

    ADMIT = "admit"
    REJECT = "reject"  # 429: overload, retry later
    PASS = "pass"  # not decided on: infeasible-but-passed, unmanaged model, fail-open
    INVALID = "invalid"  # 4xx: the request itself is unusable
    ERROR = "error"  # 5xx-class: our own failure (fail-closed)


class Reason(StrEnum):
    FITS = "fits"
    MEASURED = "measured"  # refused by the model, admitted by the measured level (decision.level)
    IDLE = "idle"  # refused by the model, admitted: an engine reports a replica with nothing to do
    DEADLINE = "deadline"  # predicted completion past the deadline budget
    TTFT = "ttft"  # predicted first token past the TTFT budget
    NO_CAPACITY = "no_capacity"  # no ready replica, or no free slot for a batch request
    KV_CACHE = "kv_cache"  # it would wait for KV memory, not a slot (docstring)
    INFEASIBLE = "infeasible"  # would miss even on an idle fleet
    CONTEXT_LENGTH = "context_length"  # longer than the model's context (the engine's 400)
    UNMANAGED = "unmanaged"  # no pool serves this model
    BAD_REQUEST = "bad_request"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA = "unsupported_media"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    PROCESSOR_OVERLOADED = "processor_overloaded"  # shed before deciding (extproc.gateway.server)
    PRIORITY = "priority"  # the room is kept for higher priorities' expected arrivals
    FAIR_SHARE = "fair_share"  # its tenant is over its share of a contended pool
    TENANT_CAP = "tenant_cap"  # its tenant is at a configured hard cap
    QUEUE_FULL = "queue_full"  # it would have been held, but the pool holds all it may
    QUEUE_DEADLINE = "queue_deadline"  # held until even alone it could not finish in time


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request asks of the GPU, in tokens (times are the model's business)."""

    prompt_tokens: int
    max_output_tokens: int  # the most it may write: max_tokens (or the pool's default) x choices
    typical_tokens: float | None = None  # ``o``, of one sequence; None: the most it may write
    promised_tokens: float | None = None  # ``L``, of its longest sequence; None: the most
    held_tokens: float | None = None  # a sequence's output in the KV cache; None: typical
    # The sequences it decodes at once (``n`` choices, prompts, ``best_of``): each takes a
    # slot, holds its own output in the KV cache and is charged its decode; they share the
    # prompt (prefilled once and forked, as vLLM does) and run side by side, so the request
    # ends with its longest one.
    sequences: int = 1
    # What one sequence writes at least (vLLM's ``min_tokens``, or what an earlier attempt of
    # the same request showed: ``extproc.decision.retries``); typical and promised include it.
    least_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.sequences < 1:
            raise ValueError(f"a request decodes at least one sequence, not {self.sequences}")

    @property
    def most(self) -> float:
        """The most one sequence may write: ``max_tokens`` (or the pool's default)."""
        return self.max_output_tokens / self.sequences

    @property
    def kv(self) -> float:
        """The KV tokens it holds: its prompt and, for each sequence, the larger of its
        typical output and what a request in flight holds of its output (``Lengths.held``;
        docstring)."""
        held = self.typical if self.held_tokens is None else min(self.held_tokens, self.most)
        return self.prompt_tokens + self.sequences * max(self.typical, held)

    @property
    def typical(self) -> float:
        o = self.typical_tokens
        return self.most if o is None else min(self.most, o)

    @property
    def promised(self) -> float:
        big_l = self.promised_tokens
        return self.most if big_l is None else min(self.most, big_l)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The ledger's view of one pool: admitted requests not yet finished."""

    inflight: int
    outstanding_ms: float
    kv_tokens: int = 0  # the KV cache its requests hold (``Cost.kv`` each)
    prefill_tokens: float = 0.0  # prompt tokens admitted and not prefilled yet (docstring)
    # per group (a priority ``p:<level>`` or tenant ``t:<name>``, extproc.decision.share) with
    # requests in flight: (in flight, outstanding ms)
    groups: Mapping[str, tuple[int, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Mix:
    """The pool's traffic: mean prompt and output tokens (learned; the context a decode
    reads and the prefill that joins a busy batch come from them)."""

    prompt_tokens: float = 1024.0
    output_tokens: float = 256.0

    @property
    def context(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2.0


@dataclass(frozen=True, slots=True)
class Reported:
    """What the engines last reported of the KV cache where a request may go: the tokens
    free on the fullest and on the emptiest replica (the same, for the replica an endpoint
    picker named), and the requests one runs or holds waiting, whose answers write more."""

    least_free: float
    most_free: float
    requests: int


@dataclass(frozen=True, slots=True)
class Capacity:
    """Ready replicas of a pool, the engine each one is, and the traffic they serve."""

    replicas: int
    engine: EngineModel = field(default_factory=EngineModel)
    mix: Mix = field(default_factory=Mix)
    wait_quantile: float = 0.97  # how sure the predicted wait must be (see the docstring)
    headroom: float = 0.0  # slots held back for interactive demand (batch requests only)
    reported: Reported | None = None  # where it goes, as last scraped (None: not scraped)
    wait_z: float = field(init=False, repr=False, compare=False)  # its normal quantile

    def __post_init__(self) -> None:
        object.__setattr__(self, "wait_z", NormalDist().inv_cdf(self.wait_quantile))

    @property
    def batch(self) -> int:
        """The sequences one replica of the pool's mix runs at once: its charge's batch."""
        return self.engine.full_batch(self.mix.prompt_tokens, self.mix.output_tokens)

    def batch_with(self, snapshot: Snapshot, cost: Cost) -> int:
        """``S`` for this decision: ``max_num_seqs``, or what a replica's KV cache holds of
        sequences the size of those in flight, this request included; at least those,
        spread over the replicas, where it fits what the engines report free, and none
        where not even its prompt does (docstring)."""
        e = self.engine
        if not e.kv_tokens:
            return e.max_num_seqs
        n, held = snapshot.inflight, snapshot.kv_tokens
        if n and not held:  # a ledger that does not keep KV tokens: the learned mix
            held = round(n * (self.mix.prompt_tokens + self.mix.output_tokens))
        footprint = (held + cost.kv) / (n + cost.sequences)
        batch = max(1, min(e.max_num_seqs, int(e.kv_tokens / footprint)))
        fits = self.fits_reported(snapshot, cost, held)
        if fits:  # all of them, spread over the replicas
            batch = max(batch, min(e.max_num_seqs, math.ceil((n + cost.sequences)
                                                             / self.replicas)))
        return 0 if fits is False else batch

    def fits_reported(self, snapshot: Snapshot, cost: Cost, held: float) -> bool | None:
        """What the KV cache the engines reported free where it may go says of this request
        (docstring): True if its own footprint fits the fullest replica's, less what the
        answers running or waiting there will still write and the prompts admitted but not
        prefilled yet (``U``), and fits a replica's share of what
        the ledger leaves free; False if not even its prompt fits the emptiest replica's
        after ``U`` (vLLM needs a prompt's blocks to prefill it); None: not reported, or
        between (the mean footprint's slots decide)."""
        r = self.reported
        if r is None or self.replicas <= 0:
            return None
        # each request there will still write what a request in flight holds of its answer
        # (``Cost.kv``: the long ones are in flight more often than arrivals are)
        growth = (cost.kv - cost.prompt_tokens) / cost.sequences
        pending = r.requests * growth + snapshot.prefill_tokens
        if cost.kv <= min(r.least_free - pending, self.engine.kv_tokens - held / self.replicas):
            return True
        if cost.prompt_tokens > r.most_free - snapshot.prefill_tokens:
            return False
        return None

    @property
    def slots(self) -> int:
        return self.replicas * self.batch

    def slots_with(self, snapshot: Snapshot, cost: Cost) -> int:
        """The pool's sequences at once for this decision (``batch_with`` on every replica)."""
        return self.replicas * self.batch_with(snapshot, cost)

    def step_ms(self, batch: float) -> float:
        """A decode step of ``batch`` sequences in a busy replica (docstring: ``step``)."""
        mix, e = self.mix, self.engine
        joining = batch / max(mix.output_tokens, 1.0)
        return e.itl_ms(batch, mix.context) + joining * e.prefill_ms(mix.prompt_tokens)

    def backlog_ms(self, tokens: float, batch: float) -> float:
        """How long a replica takes to prefill its share of ``tokens`` waiting ahead: each
        step takes ``max_num_batched_tokens`` less its decodes of them."""
        if tokens <= 0 or self.replicas <= 0:
            return 0.0
        return tokens / self.replicas / self.batch_tokens_per_ms(batch)

    def batch_tokens_per_ms(self, batch: float) -> float:
        """Prompt tokens one replica prefills a millisecond when every step is full: each step
        holds the token budget less ``batch`` decodes, which read the mix's context, and its
        chunk attends to half a mean prompt before it (``chunk_step`` in the docstring)."""
        e, mix = self.engine, self.mix
        decodes = round(batch)
        per_step = max(1.0, e.max_num_batched_tokens - decodes)
        return per_step / e.step_ms(e.max_num_batched_tokens, decodes,
                                    round(decodes * mix.context),
                                    per_step * mix.prompt_tokens / 2.0)

    def prefill_ms(self, prompt: float, batch: float) -> float:
        """Time to a first token for ``prompt`` tokens prefilled beside ``batch`` decodes."""
        e = self.engine
        per_step = max(1.0, e.max_num_batched_tokens - batch)
        chunks = max(1, math.ceil(prompt / per_step))
        return e.prefill_ms(prompt) + chunks * e.itl_ms(batch, self.mix.context)

    def charge_ms(self, cost: Cost) -> float:
        """A request's GPU share in a full batch: its ledger charge (docstring)."""
        s = self.batch
        e = self.engine
        return e.prefill_ms(cost.prompt_tokens) + cost.sequences * cost.typical * e.itl_ms(
            s, self.mix.context) / s


@dataclass(frozen=True, slots=True)
class Policy:
    """The budget a request is held to: its class's deadline (possibly tightened by the
    client) and TTFT objective, each scaled by the class's safety factor; ``batch``: the class
    takes only capacity the interactive classes leave."""

    deadline_ms: float
    safety_factor: float
    ttft_ms: float | None = None
    batch: bool = False

    @property
    def budget_ms(self) -> float:
        return self.deadline_ms * self.safety_factor

    @property
    def ttft_budget_ms(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms * self.safety_factor


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    reason: Reason
    charge_ms: float  # this request's GPU time in a full batch: its ledger charge
    wait_ms: float
    ttft_ms: float
    completion_ms: float
    budget_ms: float
    finish_at: float  # now + completion: when the request is expected to end
    retry_after_ms: float | None = None  # set on REJECT: when it would fit
    ceiling_ms: float | None = None  # set on ADMIT: the ledger's atomic check (docstring)
    max_inflight: int | None = None  # ... and the most requests in flight, this one included
    position: int = 0  # its place in the engines' queues (<= 0: a slot is free)
    step_ms: float = 0.0  # the decode step it was predicted to run at

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMIT


def release_quantile(k: int, z: float) -> float:
    """The time until the ``k``-th release of a Poisson stream, in mean gaps, at the normal
    quantile ``z`` (Wilson-Hilferty's approximation of the gamma distribution: within 1% for
    the quantiles used here, exact in the mean as ``k`` grows)."""
    return k * max(0.0, 1.0 - 1.0 / (9.0 * k) + z / (3.0 * math.sqrt(k))) ** 3


def _positions_within(position: int, replicas: int, mean_ms: float, z: float, slack_ms: float,
                      *, kv_bound: bool) -> int:
    """How many requests admitted meanwhile by other gateways this decision still tolerates:
    each pushes it one place back in the engines' queues; the free slots cost nothing, and
    then each replica's queue position costs a release (``release_quantile``) until the added
    wait eats the slack. None past the slots when the batch is bound by KV memory."""
    free = max(0, -position)
    if kv_bound or mean_ms <= 0:
        return free

    def wait(p: int) -> float:
        return release_quantile(math.ceil(p / replicas), z) * mean_ms if p > 0 else 0.0

    now_j = math.ceil(position / replicas) if position > 0 else 0
    base = wait(position)
    low, high = now_j, now_j + 1
    while high < 1 << 30 and wait(high * replicas) - base <= slack_ms:
        low, high = high, high * 2
    while high - low > 1:  # the largest queue depth (per replica) within the slack
        mid = (low + high) // 2
        if wait(mid * replicas) - base <= slack_ms:
            low = mid
        else:
            high = mid
    return free + max(0, low * replicas - max(position, 0))


def _with_it(n: int, cost: Cost, per_replica: int) -> int:
    """The sequences in flight with its own: ``n``, and its sequences, which run on one
    replica, at most its batch at once (the rest in rounds, as those end: ``rounds``).
    Its place in the engines' queues is this less their slots (<= 0: room for it now)."""
    return n + min(cost.sequences, per_replica)


def rounds(cost: Cost, per_replica: int) -> int:
    """How many times its replica's batch its sequences fill, one after another."""
    return math.ceil(cost.sequences / per_replica)


def idle_ms(cost: Cost, capacity: Capacity) -> tuple[float, float]:
    """``(ttft, completion)`` of the request's typical length alone on an idle replica: its
    sequences side by side, in as many rounds as the replica's sequence limit takes them."""
    e = capacity.engine
    ttft = capacity.prefill_ms(cost.prompt_tokens, 0.0)
    batch = min(cost.sequences, e.max_num_seqs)
    context = cost.prompt_tokens + cost.typical / 2.0
    return ttft, ttft + rounds(cost, e.max_num_seqs) * cost.typical * e.itl_ms(batch, context)


def decide(cost: Cost, snapshot: Snapshot, capacity: Capacity, policy: Policy,
           now: float) -> Decision:
    """Admit, reject (429) or declare infeasible one request; see the module docstring."""
    budget = policy.budget_ms
    ttft_budget = policy.ttft_budget_ms
    charge = capacity.charge_ms(cost)
    idle_ttft, idle_done = idle_ms(cost, capacity)
    per_replica = capacity.batch_with(snapshot, cost)
    if idle_done > budget or (ttft_budget is not None and idle_ttft > ttft_budget):
        return Decision(Outcome.PASS, Reason.INFEASIBLE, charge, 0.0, idle_ttft, idle_done,
                        budget, now + idle_done / 1000.0,
                        position=_with_it(snapshot.inflight, cost, per_replica)
                        - capacity.replicas * per_replica,
                        step_ms=capacity.step_ms(1.0))

    replicas = capacity.replicas
    if replicas <= 0:
        return Decision(Outcome.REJECT, Reason.NO_CAPACITY, charge, 0.0, idle_ttft, idle_done,
                        budget, now + idle_done / 1000.0, retry_after_ms=budget)

    n = snapshot.inflight
    mean_ms = snapshot.outstanding_ms / n if n else charge
    position = _with_it(n, cost, per_replica) - replicas * per_replica
    if per_replica == 0:  # its prompt fits no replica's reported free cache (docstring)
        position = max(position, 1)
    batch = min(float(per_replica), _with_it(n, cost, per_replica) / replicas)
    if position > 0 and per_replica < capacity.engine.max_num_seqs:
        # The batch is bound by KV memory, not by slots: it would wait for memory (docstring).
        slot_ms = mean_ms / max(per_replica, 1)
        return Decision(Outcome.REJECT, Reason.KV_CACHE, charge, 0.0, idle_ttft, idle_done,
                        budget, now + idle_done / 1000.0,
                        retry_after_ms=max(slot_ms, position * slot_ms / replicas),
                        position=position, step_ms=capacity.step_ms(batch))
    if position > 0:
        wait_ms = release_quantile(math.ceil(position / replicas), capacity.wait_z) * mean_ms
    else:
        wait_ms = 0.0
    # the prompts admitted just before it are prefilled first (FCFS chunks)
    wait_ms += capacity.backlog_ms(snapshot.prefill_tokens, batch)
    ttft_ms = wait_ms + capacity.prefill_ms(cost.prompt_tokens, batch)
    # A promise longer than the request could produce alone within its budget is capped there:
    # it then fits an idle replica, never a busy one (docstring).
    alone = (budget - capacity.prefill_ms(cost.prompt_tokens, 1.0)) / capacity.step_ms(1.0)
    promised = min(cost.promised, max(alone * (1.0 - 1e-9), 0.0))
    step_ms = capacity.step_ms(batch)
    completion_ms = ttft_ms + rounds(cost, per_replica) * promised * step_ms
    finish_at = now + completion_ms / 1000.0

    if policy.batch and position + capacity.headroom > 0:
        # Batch work only takes a free slot beyond what interactive demand needs.
        slot_ms = mean_ms / max(per_replica, 1)
        return Decision(Outcome.REJECT, Reason.NO_CAPACITY, charge, wait_ms, ttft_ms,
                        completion_ms, budget, finish_at,
                        retry_after_ms=max(slot_ms, (position + capacity.headroom) * slot_ms
                                           / replicas),
                        position=position, step_ms=step_ms)

    deadline_excess = completion_ms - budget
    ttft_excess = ttft_ms - ttft_budget if ttft_budget is not None else -math.inf
    if deadline_excess <= 0 and ttft_excess <= 0:
        slack_ms = -max(deadline_excess, ttft_excess)
        ceiling_ms = snapshot.outstanding_ms + charge + replicas * slack_ms
        most = n + 1 + _positions_within(position, replicas, mean_ms, capacity.wait_z, slack_ms,
                                         kv_bound=per_replica < capacity.engine.max_num_seqs)
        return Decision(Outcome.ADMIT, Reason.FITS, charge, wait_ms, ttft_ms, completion_ms,
                        budget, finish_at, ceiling_ms=ceiling_ms, max_inflight=most,
                        position=position, step_ms=step_ms)

    reason = Reason.DEADLINE if deadline_excess >= ttft_excess else Reason.TTFT
    excess = max(deadline_excess, ttft_excess)
    slot_ms = mean_ms / max(per_replica, 1)
    retry_ms = excess if wait_ms > 0 else max(excess, slot_ms)
    return Decision(Outcome.REJECT, reason, charge, wait_ms, ttft_ms, completion_ms, budget,
                    finish_at, retry_after_ms=retry_ms, position=position, step_ms=step_ms)
