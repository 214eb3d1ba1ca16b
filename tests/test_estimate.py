import asyncio

import pytest

from extproc.config import Pool
from extproc.decision.learning import learning_for
from extproc.decision.step import Ask, cost_of
from extproc.gateway.request import InferenceRequest
from extproc.tokens.estimate import ByteCounter, TokenizerCounter, counter_for, prompt_tokens


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer: str) -> TokenizerCounter:
    return TokenizerCounter(llama3_tokenizer)


def test_real_llama3_token_counts(llama3: TokenizerCounter) -> None:
    # Known Llama 3 tokenizations (no special tokens): words and punctuation are single tokens.
    assert llama3.count(["Hello, world!"]) == 4  # "Hello" "," " world" "!"
    assert llama3.count(["The quick brown fox jumps over the lazy dog."]) == 10
    assert llama3.count([""]) == 0
    assert llama3.count([]) == 0


def test_counts_add_up_over_texts(llama3: TokenizerCounter) -> None:
    a, b = "Summarize the patient's history.", "Include allergies and medications."
    assert llama3.count([a, b]) == llama3.count([a]) + llama3.count([b])


def test_non_latin_text_costs_more_tokens_per_character(llama3: TokenizerCounter) -> None:
    english = llama3.count(["good morning, how are you"])
    assert llama3.count(["おはようございます、お元気ですか"]) > english


def test_long_text_beyond_exact_limit_is_estimated_by_bytes(llama3_tokenizer: str) -> None:
    counter = TokenizerCounter(llama3_tokenizer, bytes_per_token=4.0, exact_max_bytes=1000)
    text = "x" * 4000
    assert counter.count([text]) == 1000


def test_byte_counter_rounds_up() -> None:
    assert ByteCounter(4.0).count(["abcde"]) == 2
    assert ByteCounter(4.0).count(["é"]) == 1  # 2 bytes
    assert ByteCounter(4.0).count([]) == 0


def test_counter_for_falls_back_to_bytes_without_tokenizer(llama3_tokenizer: str) -> None:
    assert not counter_for(Pool(name="p")).exact
    assert counter_for(Pool(name="p", tokenizer=llama3_tokenizer)).exact


def test_the_prompt_adds_template_and_flat_part_costs(llama3: TokenizerCounter) -> None:
    pool = Pool(name="p", message_overhead_tokens=4, non_text_part_tokens=100)
    req = InferenceRequest(model="m", texts=("Hello, world!",), messages=2, non_text_parts=1)
    assert prompt_tokens(req, pool, llama3.count(req.texts)) == 4 + 2 * 4 + 100
    ids = InferenceRequest(model="m", texts=(), token_ids=7)
    assert prompt_tokens(ids, pool, 0) == 7


def test_the_most_output_is_max_tokens_times_choices_and_zero_for_embeddings() -> None:
    pool = Pool(name="p", default_max_tokens=300)
    learning = learning_for(pool)
    assert cost_of(Ask("latency", 10, 50, choices=3), pool, learning).max_output_tokens == 150
    assert cost_of(Ask("latency", 10, None), pool, learning).max_output_tokens == 300
    embedding = cost_of(Ask("throughput", 10, None, prefill_only=True), pool, learning)
    assert (embedding.max_output_tokens, embedding.typical, embedding.promised) == (0, 0.0, 0.0)


def test_requests_deciding_together_are_counted_in_one_batch(llama3_tokenizer: str) -> None:
    """Batches: the texts of requests waiting at once go to the tokenizer together (a text
    twice is looked up once); each request gets its own exact count, the same as counted alone,
    and a text the tokenizer refuses fails its own request only. (The batch thread is for a
    tokenizer counted by its own call: ``pieces=False`` stands for one.)"""
    from extproc.errors import RequestError
    from extproc.tokens.pricing import Batches

    counter = TokenizerCounter(llama3_tokenizer, pieces=False)
    alone = TokenizerCounter(llama3_tokenizer)
    shared = "a system prompt every request of the conversation resends, long enough to cache"
    texts = [[shared, f"question {i}: how many tokens are in this message?"] for i in range(5)]
    calls: list[int] = []
    real = counter.counts

    def counting(batch: list[str], *, native: bool = False) -> list[int]:
        calls.append(len(batch))
        return real(batch, native=native)

    counter.counts = counting  # type: ignore[method-assign]

    async def main() -> list[int | BaseException]:
        batches = Batches()
        jobs = [batches.count(counter, t) for t in texts]
        jobs.append(batches.count(counter, ["\ud800 not encodable"]))
        return await asyncio.gather(*jobs, return_exceptions=True)

    *counts, refused = asyncio.run(main())
    assert counts == [alone.count(t) for t in texts]
    assert isinstance(refused, RequestError)
    # the first request went at once; the other five waited together: 4 x 2 texts + 1
    assert calls[:2] == [2, 9]
    assert counter.cache_size == alone.cache_size


def test_a_decision_alone_counts_on_the_loop_others_share_the_batch_thread(
        llama3_tokenizer: str) -> None:
    """pricing.OFFLOAD_WHEN_DECIDING: with no other decision under way the trip to the thread
    buys nothing, so the count is taken where the decision runs; with others deciding, it
    goes to the batch thread. The count is the same either way. A tokenizer counted a piece at
    a time (extproc.tokens.pieces: Llama 3's) always counts where the decision runs."""
    from extproc import config
    from extproc.observability.metrics import Metrics
    from extproc.tokens.pricing import Pricing

    cfg = config.from_mapping({"pools": [{"name": "llama", "models": ["*"],
                                          "tokenizer": llama3_tokenizer}]})
    pool = cfg.pools[0]
    text = "a new message, never counted before, of a few dozen tokens at the most " * 3
    thread_calls: list[int] = []

    async def price(deciding: int, suffix: str, pieces: bool = False) -> int:
        counter = TokenizerCounter(llama3_tokenizer, pieces=pieces)
        assert counter.pieces is pieces
        pricing = Pricing(cfg, Metrics(), {"llama": counter})
        real = pricing.batches.count

        async def counting(counter: object, texts: list[str]) -> int:
            thread_calls.append(len(texts))
            return await real(counter, texts)  # type: ignore[arg-type]

        pricing.batches.count = counting  # type: ignore[method-assign]
        pricing.deciding = deciding
        request = InferenceRequest(model="m", texts=(text + suffix,), messages=1)
        ask, uncounted = await pricing.ask(request, pool, "latency", None, lambda a, b: True)
        assert uncounted is None
        return ask.prompt_tokens

    alone = asyncio.run(price(1, "a"))
    assert thread_calls == []
    together = asyncio.run(price(3, "a"))
    assert thread_calls == [1] and together == alone
    assert asyncio.run(price(3, "a", pieces=True)) == alone and thread_calls == [1]
