"""One inference replica as vLLM V1 runs it: the scheduler, its KV cache, and a step-time model.

This is the fleet model of the project, in one place. The simulator (``extproc.sim.engine``,
virtual time), the fake backend (``extproc_dev.fakebackend``, real time) and the admission
defaults (``extproc.fleet.capacity``) all read the same ``EngineModel``; the simulator and the fake
backend run the same ``Scheduler``.

The scheduler (vLLM V1's ``Scheduler.schedule``, FCFS, chunked prefill always on). Each step
has a token budget, ``max_num_batched_tokens``. A request is ``prompt + generated`` tokens
long and has ``computed`` of them in the KV cache; a step gives it ``min(long - computed,
budget left)`` tokens, so a prompt is prefilled in chunks and a decode is one token.

1. Running requests first, in the order they started. A request gets the KV blocks its new
   tokens need (``block_size`` tokens a block, ``num_gpu_blocks`` in all, allocated as the
   sequence grows, never reserved ahead); when none are free the *newest* running request is
   preempted: its blocks are freed, its ``computed`` drops to 0 (recomputation), and it goes
   back to the head of the waiting queue. If the request itself was the newest, it waits.
2. Then, only if nothing was preempted this step, waiting requests in order while the budget
   lasts and fewer than ``max_num_seqs`` run: a new request first takes the tokens of its
   shared prefix that the prefix cache holds (no compute), then a chunk of the rest; when its
   chunk's blocks are not free it stays at the head and blocks those behind it (FCFS).
3. After the step every request whose ``computed`` reached its length samples one token; a
   request leaves with its last token and its blocks return. A finished request's shared
   prefix stays in the prefix cache (vLLM keeps freed blocks hashed until they are reused).

The step time, a roofline of one forward pass, linear in what the step holds::

    step_ms = step_base_ms                                  weights read once per step
            + ms_per_token     x tokens scheduled           (prefill chunks and decodes alike)
            + ms_per_seq       x decoding sequences         (sampling, per-sequence kernels)
            + ms_per_kv_token  x context the decodes read   (attention reads their KV cache)
            + ms_per_prefill_pair x sum(chunk x (context before it + chunk / 2))
                                                            (prefill attention, quadratic)

so a batch of ``b`` decodes at context ``c`` steps in ``itl(b, c) = step_base_ms + b x
(ms_per_token + ms_per_seq + ms_per_kv_token x c)`` and a lone prompt of ``P`` tokens starts
after about ``P x ms_per_token + P^2 / 2 x ms_per_prefill_pair`` (plus one step per chunk).

Calibration (``LLAMA_70B_FP8_2XH100``, the default; ``docs/simulator.md`` shows the tables).
Llama-3.3-70B in FP8 on two H100 80GB with tensor parallelism, vLLM's defaults for a GPU with
at least 70 GiB (``max_num_batched_tokens`` 8192, ``max_num_seqs`` 1024, block size 16):

- the design brief's measurements for that pair: inter-token latency 18.6 ms for one running
  request, 59.7 ms at 50 and about 93 ms at 100 concurrent requests, prefill about 0.08 ms a
  token. ``step_base_ms + ms_per_token`` is the first; ``ms_per_token`` the last. The latency
  at 50 and 100 was measured under a serving load, so it holds the prefill chunks of the
  requests joining the batch: ``ms_per_seq`` is fitted so that a closed loop of 50 clients
  with the Azure conversation trace's lengths reproduces 59.7 ms
  (``calibration_itl_ms``); 100 clients then give the 93 ms within a few percent;
- the KV cache: the model's 80 layers x 8 KV heads x 128 dimensions x (K, V) x 2 bytes (the
  default BF16 cache) = 320 KiB a token; 2 x 80 GB x 0.9 (``gpu_memory_utilization``) less
  ~70 GB of FP8 weights and ~6 GB of activations and CUDA graphs leaves ~65 GB: 12,800 blocks
  of 16, 204,800 tokens a replica;
- ``ms_per_kv_token``: 320 KiB read at ~70% of the pair's 6.7 TB/s, 7e-5 ms a token;
- ``ms_per_prefill_pair``: 4 x 80 layers x 64 heads x 128 = 2.6 MFLOP per query-key pair at
  ~1.2 PFLOP/s of attention: 2.2e-6 ms (a 128k-token prompt: ~10 s linear + ~18 s attention).

``LLAMA_8B_1XH100``: Llama-3.1-8B in BF16 on one H100 (design brief: 4.6 ms a token at 1,
7.6 at 100 and 16.1 at 250 concurrent; 32 layers x 8 KV heads: 128 KiB a token, ~50 GB of
cache: 24,000 blocks).

Length: past the house's ~400 lines because the scheduler is one class that the simulator,
the fake backend and the admission model share, and its rules change together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineModel:
    """One replica: vLLM's scheduler settings and the step-time coefficients (docstring)."""

    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 12_800  # 0: unlimited KV cache
    max_model_len: int = 131_072
    prefix_caching: bool = True
    step_base_ms: float = 18.2
    ms_per_token: float = 0.08
    ms_per_seq: float = 0.32
    ms_per_kv_token: float = 7e-5
    ms_per_prefill_pair: float = 2.2e-6

    def __post_init__(self) -> None:
        errors = []
        counts = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in counts and value < 1:  # one line per field: its tightest bound
                errors.append(f"{f.name} must be >= 1, got {value}")
            elif f.name != "prefix_caching" and (not math.isfinite(value) or value < 0):
                errors.append(f"{f.name} must be >= 0, got {value}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds (0: unlimited)."""
        return self.num_gpu_blocks * self.block_size

    def itl_ms(self, batch: float, context: float = 0.0) -> float:
        """A step of ``batch`` decodes at mean ``context`` tokens, nothing else in it."""
        if batch <= 0:
            return self.step_base_ms
        per_seq = self.ms_per_token + self.ms_per_seq + self.ms_per_kv_token * context
        return self.step_base_ms + batch * per_seq

    def prefill_ms(self, tokens: float, context: float = 0.0) -> float:
        """GPU time of ``tokens`` of prefill after ``context`` tokens already in the cache
        (the linear part and the attention part; the steps' base cost is not in it)."""
        return tokens * (self.ms_per_token
                         + self.ms_per_prefill_pair * (context + tokens / 2.0))

    def full_batch(self, mean_prompt: float, mean_output: float) -> int:
        """The batch a replica holds at most: ``max_num_seqs``, or what its KV cache holds of
        sequences at their mean final length, whichever is less."""
        if not self.kv_tokens:
            return self.max_num_seqs
        return max(1, min(self.max_num_seqs, int(self.kv_tokens / (mean_prompt + mean_output))))

    def request_ms(self, mean_prompt: float, mean_output: float) -> float:
        """A mean request's share of a replica's time in a full batch: its prefill, and its
        tokens at ``1 / b`` of a decode step of ``b`` sequences at the mean context. A
        replica completes ``1000 / request_ms`` requests a second with its batch full."""
        b = self.full_batch(mean_prompt, mean_output)
        context = mean_prompt + mean_output / 2.0
        return self.prefill_ms(mean_prompt) + mean_output * self.itl_ms(b, context) / b

    def scaled(self, factor: float) -> EngineModel:
        """Every time coefficient times ``factor`` (the demo and tests run faster)."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name) * factor for f in fields(self)
            if f.name.startswith(("step_", "ms_"))})

    def step_ms(self, tokens: int, decodes: int, decode_context: int, prefill_pairs: float
                ) -> float:
        """One step's time from what it holds (the module docstring's formula)."""
        return (self.step_base_ms + self.ms_per_token * tokens + self.ms_per_seq * decodes
                + self.ms_per_kv_token * decode_context
                + self.ms_per_prefill_pair * prefill_pairs)


LLAMA_70B_FP8_2XH100 = EngineModel()
LLAMA_8B_1XH100 = EngineModel(
    num_gpu_blocks=24_000, step_base_ms=4.59, ms_per_token=0.008, ms_per_seq=0.01,
    ms_per_kv_token=4e-5, ms_per_prefill_pair=7.5e-7)
PRESETS = {"llama-70b-fp8-2xh100": LLAMA_70B_FP8_2XH100, "llama-8b-1xh100": LLAMA_8B_1XH100}


class Sequence:
    """One request inside an engine. ``output_tokens``: what it will generate (the engine
    stops it there, as a stop token or ``max_tokens`` would). Subclasses add their own state
    (the simulator's attempt, the fake backend's token queue)."""

    __slots__ = (
        "blocks",
        "computed",
        "done",
        "generated",
        "output_tokens",
        "preemptions",
        "prefix_key",
        "prefix_tokens",
        "prompt_tokens",
    )

    def __init__(self, prompt_tokens: int, output_tokens: int, prefix_key: object = None,
                 prefix_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.prefix_key = prefix_key  # requests sharing a prefix share this key
        self.prefix_tokens = prefix_tokens  # ... and this many leading prompt tokens
        self.computed = 0  # tokens in the KV cache
        self.generated = 0  # tokens sampled
        self.blocks = 0  # KV blocks held
        self.preemptions = 0
        self.done = False  # finished or removed: a step that held it skips it

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class Step:
    """What one step holds, and how long it takes."""

    seqs: list[Sequence]
    tokens: list[int]  # tokens scheduled for each of ``seqs``
    duration_ms: float
    decodes: int  # sequences decoding (one token each, past their prompt)
    decode_context: int  # tokens of context those decodes read
    prefill_tokens: int
    joined: list[Sequence]  # newly running this step (new or resumed)
    preempted: list[Sequence]

    @property
    def pure_decode(self) -> bool:
        return self.prefill_tokens == 0 and not self.joined and not self.preempted


class Scheduler:
    """A replica's waiting queue, running batch and KV cache (module docstring, rules 1-3)."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_blocks = model.num_gpu_blocks
        self._limited = model.num_gpu_blocks > 0
        self._prefixes: dict[object, int] = {}  # prefix key -> tokens cached (LRU order)
        self._cached_tokens = 0

    # ---- requests in and out ----
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is (an abort); its blocks return."""
        if seq.done:
            return
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)

    @property
    def kv_used_blocks(self) -> int:
        return self.model.num_gpu_blocks - self.free_blocks if self._limited else 0

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether ``seq`` could ever run: its prompt and output within ``max_model_len``
        (vLLM refuses a longer request with a 400) and the KV cache."""
        total = seq.prompt_tokens + seq.output_tokens
        return total <= self.model.max_model_len and (
            not self._limited or total <= self.model.kv_tokens)

    # ---- one step ----
    def schedule(self) -> Step | None:
        """The next step (rules 1 and 2), blocks allocated; None when nothing can run."""
        m = self.model
        budget = m.max_num_batched_tokens
        running = self.running
        seqs: list[Sequence] = []
        tokens: list[int] = []
        preempted: list[Sequence] = []
        joined: list[Sequence] = []
        decodes = context = prefill = 0
        pairs = 0.0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            want = min(seq.prompt_tokens + seq.generated - seq.computed, budget)
            while not self._allocate(seq, want):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    want = 0
                    break
            if want == 0:
                break
            seqs.append(seq)
            tokens.append(want)
            budget -= want
            if want == 1 and seq.generated > 0 and seq.computed + 1 == seq.length:
                decodes += 1
                context += seq.computed
            else:
                prefill += want
                pairs += want * (seq.computed + want / 2.0)
            i += 1
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < m.max_num_seqs:
                seq = waiting[0]
                hit = self._prefix_hit(seq) if seq.computed == 0 else 0
                want = min(seq.length - seq.computed - hit, budget)
                if want <= 0 or not self._allocate(seq, want, hit):
                    break
                waiting.popleft()
                seq.computed += hit
                running.append(seq)
                joined.append(seq)
                seqs.append(seq)
                tokens.append(want)
                budget -= want
                prefill += want
                pairs += want * (seq.computed + want / 2.0)
        if not seqs:
            return None
        used = m.max_num_batched_tokens - budget
        return Step(seqs, tokens, m.step_ms(used, decodes, context, pairs), decodes, context,
                    prefill, joined, preempted)

    def complete(self, step: Step) -> list[Sequence]:
        """Apply a step (rule 3); return the sequences that finished with it."""
        finished: list[Sequence] = []
        for seq, n in zip(step.seqs, step.tokens, strict=True):
            if seq.done:
                continue  # removed (aborted) while the step ran
            seq.computed += n
            if seq.computed >= seq.length:
                seq.generated += 1
                if seq.generated >= seq.output_tokens:
                    finished.append(seq)
        self._finish(finished)
        return finished

    def _finish(self, finished: list[Sequence]) -> None:
        if not finished:
            return
        gone = set(map(id, finished))
        self.running = [s for s in self.running if id(s) not in gone]
        for seq in finished:
            seq.done = True
            self._free(seq)
            self._remember_prefix(seq)

    # ---- runs of identical decode steps (the simulator's shortcut) ----
    def decode_run(self) -> int:
        """After a ``pure_decode`` step was scheduled: how many steps in a row, that one
        included, stay pure decodes of the same batch: until the first sequence finishes or
        the cache runs out of blocks for the growing sequences (a preemption), whichever is
        first. (A new request can join only where something finishes, or at an arrival, which
        the caller handles.)"""
        running = self.running
        k = min(s.output_tokens - s.generated for s in running)
        if not self._limited or k <= 1:
            return max(1, k)
        bs = self.model.block_size
        free = self.free_blocks

        def extra(j: int) -> int:  # blocks needed beyond the first step's, by step j
            return sum(-(-(s.computed + j) // bs) - s.blocks for s in running)

        if extra(k) <= free:
            return k
        lo, hi = 1, k  # extra(lo) <= free < extra(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def advance(self, steps: int) -> list[Sequence]:
        """Apply ``steps`` pure-decode steps of the current batch at once (the first already
        scheduled, its blocks allocated); the blocks the later ones need are allocated here
        (``decode_run`` checked they are free). Returns the sequences that finished."""
        bs = self.model.block_size
        finished: list[Sequence] = []
        for seq in self.running:
            seq.computed += steps
            seq.generated += steps
            need = -(-seq.computed // bs)
            if need > seq.blocks:
                self.free_blocks -= need - seq.blocks
                seq.blocks = need
            if seq.generated >= seq.output_tokens:
                finished.append(seq)
        self._finish(finished)
        return finished

    def run_ms(self, first_ms: float, steps: int) -> float:
        """The time of ``steps`` decode steps of the current batch, the first lasting
        ``first_ms``: each later step reads one more token of context per sequence."""
        growth = self.model.ms_per_kv_token * len(self.running)
        return steps * first_ms + growth * steps * (steps - 1) / 2.0

    def steps_within(self, first_ms: float, elapsed_ms: float) -> int:
        """How many steps of the current run have started by ``elapsed_ms``: the step in
        progress then ends at boundary ``steps_within(...)`` (at least 1)."""
        growth = self.model.ms_per_kv_token * len(self.running)
        if growth <= 0.0:
            return max(1, math.floor(elapsed_ms / first_ms) + 1)
        # steps j with run_ms(j) <= elapsed: j first_ms + growth j (j - 1) / 2 <= elapsed
        a, b = growth / 2.0, first_ms - growth / 2.0
        j = math.floor((-b + math.sqrt(b * b + 4.0 * a * elapsed_ms)) / (2.0 * a))
        while j > 0 and self.run_ms(first_ms, j) > elapsed_ms:
            j -= 1
        while self.run_ms(first_ms, j + 1) <= elapsed_ms:
            j += 1
        return j + 1

    # ---- KV blocks ----
    def _allocate(self, seq: Sequence, tokens: int, hit: int = 0) -> bool:
        if not self._limited:
            return True
        need = -(-(seq.computed + hit + tokens) // self.model.block_size) - seq.blocks
        if need > self.free_blocks:
            return False
        if need > 0:
            self.free_blocks -= need
            seq.blocks += need
        return True

    def _free(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- prefix cache ----
    def _prefix_hit(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s shared prefix already cached, whole blocks, never the whole
        prompt (its last token is always computed, as in vLLM)."""
        if not self.model.prefix_caching or seq.prefix_key is None:
            return 0
        cached = self._prefixes.get(seq.prefix_key, 0)
        hit = min(cached, seq.prefix_tokens, seq.prompt_tokens - 1)
        return max(0, hit - hit % self.model.block_size)

    def _remember_prefix(self, seq: Sequence) -> None:
        """Cache what a finished request leaves for the next turn of its conversation: its
        prompt and output, under its prefix key. Bounded by the cache size (oldest first)."""
        if not self.model.prefix_caching or seq.prefix_key is None:
            return
        key, tokens = seq.prefix_key, seq.prompt_tokens + seq.generated
        old = self._prefixes.pop(key, 0)
        self._cached_tokens += tokens - old
        self._prefixes[key] = tokens
        limit = self.model.kv_tokens or 1 << 40
        while self._cached_tokens > limit and self._prefixes:
            self._cached_tokens -= self._prefixes.pop(next(iter(self._prefixes)))


def calibration_itl_ms(model: EngineModel, clients: int, prompts: Iterable[int],
                       outputs: Iterable[int], requests: int = 3000) -> float:
    """Mean inter-token latency, ``(last token - first token) / (tokens - 1)`` per request,
    of ``clients`` closed-loop clients (each sends its next request when its last one ends),
    lengths cycling through ``prompts`` / ``outputs``: the way serving benchmarks measure it
    at a concurrency. The first ``clients`` requests (the cold start) are left out."""
    sched = Scheduler(model)
    ps, outs = list(prompts), list(outputs)
    started: dict[int, float] = {}
    n = 0
    now = 0.0
    itls: list[float] = []

    def send() -> None:
        nonlocal n
        sched.add(Sequence(ps[n % len(ps)], max(2, outs[n % len(outs)])))
        n += 1

    for _ in range(clients):
        send()
    while len(itls) < requests:
        step = sched.schedule()
        assert step is not None
        now += step.duration_ms
        for seq, k in zip(step.seqs, step.tokens, strict=True):
            if seq.generated == 0 and seq.computed + k >= seq.length:
                started[id(seq)] = now
        for seq in sched.complete(step):
            first = started.pop(id(seq))
            if n > 2 * clients:
                itls.append((now - first) / (seq.generated - 1))
            send()
    return sum(itls) / len(itls)
