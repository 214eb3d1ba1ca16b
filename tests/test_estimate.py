import pytest

from extproc.config import Pool
from extproc.estimate import ByteCounter, TokenizerCounter, counter_for, estimate
from extproc.request import InferenceRequest


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


def test_estimate_adds_template_and_flat_part_costs(llama3: TokenizerCounter) -> None:
    pool = Pool(name="p", message_overhead_tokens=4, non_text_part_tokens=100,
                default_max_tokens=300)
    req = InferenceRequest(model="m", texts=("Hello, world!",), messages=2, non_text_parts=1)
    cost = estimate(req, pool, llama3)
    assert cost.prompt_tokens == 4 + 2 * 4 + 100
    assert cost.output_tokens == 300  # the pool default when max_tokens is absent


def test_estimate_output_is_max_tokens_times_choices_and_zero_for_embeddings(
        llama3: TokenizerCounter) -> None:
    pool = Pool(name="p")
    gen = InferenceRequest(model="m", texts=(), token_ids=7, max_tokens=50, choices=3)
    assert estimate(gen, pool, llama3).output_tokens == 150
    assert estimate(gen, pool, llama3).prompt_tokens == 7
    emb = InferenceRequest(model="m", texts=("a b c",), choices=0, prefill_only=True)
    assert estimate(emb, pool, llama3).output_tokens == 0
