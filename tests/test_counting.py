"""Counting prompt tokens fast: the per-text cache, the calibrated estimate for long cold
prompts, and the exact correction of the ledger afterwards (``extproc.gateway.gate`` docstring)."""

import asyncio
import json
import random
import threading
from typing import Any

import pytest

from extproc import config
from extproc.decision.step import Ask, charge_of
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.gateway.request import parse
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc.tokens.estimate import Calibration, TokenizerCounter, prompt_tokens
from extproc.tokens.pricing import COUNT_WAIT_S, ESTIMATE_CHARS, MAX_PENDING_COUNTS

WORDS = ("the", "patient", "reports", "mild", "pain", "after", "surgery", "and", "asks",
         "whether", "the", "dose", "should", "change;", "summarize", "the", "history,", "list",
         "allergies,", "compare", "both", "trials", "and", "explain", "the", "risk")


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randint(0, 999)) if rng.random() < 0.2 else "")
                    for _ in range(words))


@pytest.fixture(scope="module")
def counter(llama3_tokenizer: str) -> TokenizerCounter:
    return TokenizerCounter(llama3_tokenizer)


class Spy(TokenizerCounter):
    """A real counter that records which texts it had to tokenize."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.tokenized: list[int] = []  # lengths of the texts sent to the tokenizer

    def count(self, texts: Any) -> int:
        _, missing = self.cached(texts)
        self.tokenized.extend(len(t) for t in missing)
        return super().count(texts)


def test_a_chat_turn_tokenizes_only_its_new_message(llama3_tokenizer: str) -> None:
    rng = random.Random(1)
    spy = Spy(llama3_tokenizer)
    history: list[str] = []
    for turn in range(5):
        history.append(prose(rng, 150))
        spy.tokenized.clear()
        total = spy.count(history)
        assert spy.tokenized == [len(history[-1])], f"turn {turn}"
        assert total == TokenizerCounter(llama3_tokenizer).count(history)  # exact, cold


def test_the_cache_is_bounded_keeps_what_is_used_and_holds_no_text(
        llama3_tokenizer: str) -> None:
    spy = Spy(llama3_tokenizer, cache_entries=4)  # two generations of two
    texts = [f"document number {i} " + "lorem ipsum dolor sit amet " * 4 for i in range(3)]
    spy.count(texts[:2])  # the young generation is full: it becomes the old one
    spy.count([texts[2]])
    spy.count([texts[0]])  # used again: into the young one, which is full again
    spy.tokenized.clear()
    spy.count([texts[0], texts[2]])
    assert spy.tokenized == []
    spy.count([texts[1]])  # not used for a generation: dropped, tokenized again
    assert spy.tokenized == [len(texts[1])]
    assert spy.cache_size <= 4
    keys = list(spy.cache)
    assert all(isinstance(k, tuple) and all(isinstance(x, int) for x in k) for k in keys)


def test_short_texts_are_not_cached(counter: TokenizerCounter) -> None:
    known, missing = counter.cached(["hi there"])
    counter.count(["hi there"])
    assert counter.cached(["hi there"]) == (known, missing) == (0, ["hi there"])


def test_calibration_learns_the_ratio_and_narrows_its_margin(
        counter: TokenizerCounter) -> None:
    rng = random.Random(2)
    cal = Calibration(bytes_per_token=2.0)  # deliberately wrong start: 0.5 tokens per char
    wide = cal.margin
    for _ in range(100):
        text = prose(rng, 400)
        cal.learn(len(text), counter.count([text]))
    text = prose(rng, 2000)
    exact = counter.count([text])
    assert cal.estimate(len(text)) == pytest.approx(exact, rel=0.05)
    assert cal.margin < wide and cal.margin <= 0.15


def settings(engine: dict[str, Any] | None = None, **pool: Any) -> config.Config:
    return config.from_mapping({"pools": [{"name": "llama", "replicas": 1,
                                           "engine": {"max_num_seqs": 8, **(engine or {})},
                                           "tokenizer": pool.pop("tokenizer"), **pool}]})


def chat(text: str, max_tokens: int = 100) -> bytes:
    return json.dumps({"model": "m", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": text}]}).encode()


async def test_a_long_cold_prompt_is_decided_on_an_estimate_and_the_ledger_made_exact(
        llama3_tokenizer: str) -> None:
    cfg = settings(tokenizer=llama3_tokenizer)
    ledger, metrics = MemoryLedger(), Metrics()
    gate = Gate(cfg, ledger, StaticCapacity(cfg.pools), metrics)
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    text = prose(random.Random(3), 6000)
    assert len(text) > ESTIMATE_CHARS
    verdict = await gate.check(route, "/v1/chat/completions", {}, chat(text))
    assert verdict.ticket is not None and verdict.ticket.correction is not None
    assert metrics.prompt_counts.labels("llama", "estimated")._value.get() == 1
    await verdict.ticket.correction
    pool = cfg.pools[0]
    request = parse(route.api, chat(text))
    exact_prompt = prompt_tokens(request, pool,
                                 TokenizerCounter(llama3_tokenizer).count(request.texts))
    exact = charge_of(Ask("latency", exact_prompt, request.max_tokens), pool,
                      gate.learning["llama"], 1)
    assert (await ledger.snapshot("llama")).outstanding_ms == pytest.approx(exact, rel=1e-12)
    assert verdict.ticket.charge_ms == pytest.approx(exact, rel=1e-12)
    await gate.settle(verdict.ticket)
    assert await ledger.snapshot("llama") == await MemoryLedger().snapshot("llama")
    # The same prompt again is all cached: counted exactly, at once.
    again = await gate.check(route, "/v1/chat/completions", {}, chat(text))
    assert again.ticket is not None and again.ticket.correction is None
    # (the pool's mix learned from the first request since: the same charge rule, today's mix)
    exact = charge_of(Ask("latency", exact_prompt, request.max_tokens), pool,
                      gate.learning["llama"], 1)
    assert again.ticket.charge_ms == pytest.approx(exact, rel=1e-12)
    assert metrics.prompt_counts.labels("llama", "cached")._value.get() == 1
    await gate.settle(again.ticket)


async def test_a_close_decision_waits_for_the_exact_count(llama3_tokenizer: str) -> None:
    # About 8,000 tokens at 0.2 ms each is right at the 1.6 s TTFT budget (2 s x 0.8): the
    # estimate's low end admits, its high end does not.
    text = prose(random.Random(4), 6500)
    tokens = TokenizerCounter(llama3_tokenizer).count([text])
    cfg = settings(tokenizer=llama3_tokenizer,
                   engine={"ms_per_token": 1600.0 / tokens * 0.97, "step_base_ms": 0.0})
    metrics = Metrics()
    gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), metrics)
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    verdict = await gate.check(route, "/v1/chat/completions", {}, chat(text))
    assert metrics.prompt_counts.labels("llama", "awaited")._value.get() == 1
    assert verdict.ticket is not None and verdict.ticket.correction is None
    assert verdict.prompt_tokens == tokens + cfg.pools[0].message_overhead_tokens
    await gate.settle(verdict.ticket)


async def test_a_close_decision_waits_a_bounded_time_then_decides_on_the_high_end(
        llama3_tokenizer: str) -> None:
    # Same close call, but the counting thread is busy: the decision does not wait past
    # COUNT_WAIT_S; it is taken on the estimate's high end (counted as a fall-through) and
    # the exact count, when it comes, corrects the ledger.
    text = prose(random.Random(4), 6500)
    tokens = TokenizerCounter(llama3_tokenizer).count([text])
    cfg = settings(tokenizer=llama3_tokenizer,
                   engine={"ms_per_token": 1600.0 / tokens * 0.97, "step_base_ms": 0.0})
    metrics = Metrics()
    ledger = MemoryLedger()
    gate = Gate(cfg, ledger, StaticCapacity(cfg.pools), metrics)
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    busy = threading.Event()
    loop = asyncio.get_running_loop()
    blocker = loop.run_in_executor(gate.pricing.counting, busy.wait, 5.0)
    started = loop.time()
    verdict = await gate.check(route, "/v1/chat/completions", {}, chat(text))
    waited = loop.time() - started
    assert COUNT_WAIT_S <= waited < COUNT_WAIT_S + 1.0
    assert metrics.fallthroughs.labels("count_wait")._value.get() == 1
    assert verdict.prompt_tokens > tokens  # the high end of the estimate
    busy.set()
    await blocker
    if verdict.ticket is not None:  # admitted on the high end: the count corrects the charge
        assert verdict.ticket.correction is not None
        await verdict.ticket.correction
        request = parse(route.api, chat(text))
        exact = charge_of(Ask("latency", prompt_tokens(request, cfg.pools[0], tokens),
                              request.max_tokens), cfg.pools[0], gate.learning["llama"], 1)
        assert (await ledger.snapshot("llama")).outstanding_ms == pytest.approx(exact,
                                                                                rel=1e-9)
        await gate.settle(verdict.ticket)


async def test_corrections_waiting_for_the_counting_thread_are_bounded(
        llama3_tokenizer: str) -> None:
    cfg = settings(tokenizer=llama3_tokenizer, replicas=64)
    gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), Metrics())
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    rng = random.Random(5)
    verdicts = [await gate.check(route, "/v1/chat/completions", {}, chat(prose(rng, 3000)))
                for _ in range(MAX_PENDING_COUNTS + 4)]  # faster than one thread counts
    corrections = [v.ticket.correction for v in verdicts if v.ticket is not None]
    assert len(corrections) == MAX_PENDING_COUNTS + 4
    queued = [c for c in corrections if c is not None]
    assert len(queued) == MAX_PENDING_COUNTS  # the rest keep their estimate
    await asyncio.gather(*queued)
    assert gate.pricing.pending == 0
    for v in verdicts:
        assert v.ticket is not None
        await gate.settle(v.ticket)
