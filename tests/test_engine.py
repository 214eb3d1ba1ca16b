"""The engine model: vLLM V1's scheduling rules and the step-time formula (extproc.fleet.engine)."""

from __future__ import annotations

import csv
import gzip
import random
from pathlib import Path

import pytest

from extproc.fleet.engine import (
    LLAMA_8B_1XH100,
    LLAMA_70B_FP8_2XH100,
    EngineModel,
    Scheduler,
    Sequence,
    calibration_itl_ms,
)

SMALL = EngineModel(max_num_seqs=3, max_num_batched_tokens=10, block_size=4, num_gpu_blocks=12,
                    max_model_len=40, step_base_ms=10.0, ms_per_token=1.0, ms_per_seq=0.5,
                    ms_per_kv_token=0.01, ms_per_prefill_pair=0.001)
TRACES = Path(__file__).resolve().parent / "data" / "traces"


def run_to_end(sched: Scheduler, limit: int = 10_000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(limit):
        step = sched.schedule()
        if step is None:
            return finished
        finished += sched.complete(step)
    raise AssertionError("did not finish")


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    sched = Scheduler(SMALL)
    seq = Sequence(prompt_tokens=25, output_tokens=2)
    sched.add(seq)
    chunks = []
    while seq.generated == 0:
        step = sched.schedule()
        assert step is not None
        chunks.append(step.tokens[0])
        sched.complete(step)
    assert chunks == [10, 10, 5]  # the first token comes with the last chunk
    assert seq.generated == 1


def test_running_decodes_are_scheduled_before_a_new_prompt_which_gets_the_rest() -> None:
    sched = Scheduler(SMALL)
    a = Sequence(4, 5)
    sched.add(a)
    sched.complete(sched.schedule())  # a prefilled, first token out
    b = Sequence(20, 1)
    sched.add(b)
    step = sched.schedule()
    assert step is not None
    assert step.seqs == [a, b] and step.tokens == [1, 9]  # a decodes, b gets 10 - 1
    assert step.decodes == 1 and step.prefill_tokens == 9 and step.joined == [b]


def test_the_step_time_follows_the_formula() -> None:
    sched = Scheduler(SMALL)
    a = Sequence(4, 5)
    sched.add(a)
    first = sched.schedule()
    assert first is not None
    # prefill of 4 tokens from context 0: pairs = 4 x (0 + 4 / 2) = 8
    assert first.duration_ms == pytest.approx(10.0 + 4 * 1.0 + 8 * 0.001)
    sched.complete(first)
    decode = sched.schedule()
    assert decode is not None
    # one decode reading 4 tokens of context
    assert decode.duration_ms == pytest.approx(10.0 + 1.0 + 0.5 + 4 * 0.01)
    assert decode.duration_ms == pytest.approx(SMALL.itl_ms(1, 4))


def test_no_more_than_max_num_seqs_run_and_the_rest_wait_in_order() -> None:
    sched = Scheduler(EngineModel(max_num_seqs=2, num_gpu_blocks=0))
    seqs = [Sequence(10, 3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step is not None and step.joined == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    finished = run_to_end(sched)
    assert finished == seqs  # FCFS: they finish in order


def test_kv_blocks_are_allocated_as_sequences_grow_and_returned_when_they_finish() -> None:
    sched = Scheduler(SMALL)
    seq = Sequence(6, 5)  # 6 + 5 = 11 tokens: 3 blocks of 4 at the end
    sched.add(seq)
    sched.complete(sched.schedule())
    assert seq.blocks == 2 and sched.free_blocks == 10  # 6 prompt tokens: 2 blocks
    for _ in range(3):
        sched.complete(sched.schedule())
    assert seq.blocks == 3  # 9 tokens computed: 3 blocks
    run_to_end(sched)
    assert sched.free_blocks == 12


def test_when_blocks_run_out_the_newest_running_sequence_is_preempted_and_recomputed() -> None:
    model = EngineModel(max_num_seqs=4, max_num_batched_tokens=100, block_size=4,
                        num_gpu_blocks=6, max_model_len=24, step_base_ms=1.0)
    sched = Scheduler(model)
    old, new = Sequence(8, 12), Sequence(8, 12)  # each grows to 20 tokens: 5 blocks
    sched.add(old)
    sched.add(new)
    step = sched.schedule()
    assert step is not None and step.joined == [old, new]  # 2 + 2 blocks of 6
    sched.complete(step)
    preempted = []
    while not preempted:
        step = sched.schedule()
        assert step is not None
        preempted = step.preempted
        sched.complete(step)
    assert preempted == [new]  # the newest goes
    assert new.computed == 0 and new.generated > 0 and new.preemptions == 1
    assert sched.waiting[0] is new
    finished = run_to_end(sched)
    assert finished == [old, new]  # recomputed once the old one left
    assert new.generated == 12 and sched.free_blocks == 6


def test_a_waiting_request_whose_blocks_are_not_free_blocks_those_behind_it() -> None:
    sched = Scheduler(SMALL)  # 12 blocks of 4
    big = Sequence(36, 1)  # 9 blocks
    sched.add(big)
    step = sched.schedule()
    assert step is not None
    sched.complete(step)  # 10 of 36 prefilled: 3 blocks
    blocker, small = Sequence(16, 1), Sequence(1, 1)
    sched.add(blocker)
    sched.add(small)
    while big.generated == 0:
        step = sched.schedule()
        assert step is not None
        assert small not in step.seqs or blocker in sched.running
        sched.complete(step)
    run_to_end(sched)
    assert blocker.generated == 1 and small.generated == 1


def test_prefix_cache_skips_the_shared_prefix_of_the_next_turn() -> None:
    model = EngineModel(max_num_seqs=4, max_num_batched_tokens=1000, block_size=16,
                        num_gpu_blocks=0, step_base_ms=1.0)
    sched = Scheduler(model)
    turn1 = Sequence(100, 20, prefix_key="conv", prefix_tokens=0)
    sched.add(turn1)
    run_to_end(sched)
    turn2 = Sequence(150, 5, prefix_key="conv", prefix_tokens=120)
    sched.add(turn2)
    step = sched.schedule()
    assert step is not None
    assert step.tokens == [150 - 112]  # 120 cached, 112 of it in whole blocks
    off = Scheduler(EngineModel(max_num_seqs=4, max_num_batched_tokens=1000, num_gpu_blocks=0,
                                prefix_caching=False))
    again = Sequence(150, 5, prefix_key="conv", prefix_tokens=120)
    off.add(Sequence(100, 20, prefix_key="conv"))
    run_to_end(off)
    off.add(again)
    step = off.schedule()
    assert step is not None and step.tokens == [150]


def test_a_request_longer_than_the_model_or_the_cache_never_fits() -> None:
    sched = Scheduler(SMALL)
    assert sched.fits_alone(Sequence(30, 10))
    assert not sched.fits_alone(Sequence(30, 11))  # max_model_len 40
    tiny = Scheduler(EngineModel(num_gpu_blocks=2, block_size=16, max_model_len=1000))
    assert not tiny.fits_alone(Sequence(30, 3))


def test_an_aborted_sequence_leaves_and_frees_its_blocks() -> None:
    sched = Scheduler(SMALL)
    a, b = Sequence(4, 10), Sequence(4, 10)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step is not None
    sched.remove(b)  # while the step runs
    sched.complete(step)
    assert sched.running == [a] and b.generated == 0 and sched.free_blocks == 11


def test_a_decode_run_advanced_at_once_equals_stepping_one_by_one() -> None:
    rng = random.Random(3)
    model = EngineModel(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                        num_gpu_blocks=60, max_model_len=200, ms_per_kv_token=0.01)
    jumps = 0
    for _ in range(20):
        lengths = [(rng.randint(1, 30), rng.randint(1, 40)) for _ in range(6)]
        runs = []
        for jump in (False, True):
            sched = Scheduler(model)
            seqs = [Sequence(p, o) for p, o in lengths]
            for s in seqs:
                sched.add(s)
            index = {id(s): i for i, s in enumerate(seqs)}
            now, done = 0.0, []
            while (step := sched.schedule()) is not None:
                if jump and step.pure_decode:
                    k = sched.decode_run()
                    jumps += k > 1
                    now += sched.run_ms(step.duration_ms, k)
                    finished = sched.advance(k)
                else:
                    now += step.duration_ms
                    finished = sched.complete(step)
                done += [(index[id(s)], now) for s in finished]
            runs.append(done)
        stepped, jumped = runs
        assert [i for i, _ in jumped] == [i for i, _ in stepped]
        assert [t for _, t in jumped] == pytest.approx([t for _, t in stepped])
    assert jumps > 20  # the shortcut was taken, preemptions included


def test_steps_within_finds_the_boundary_of_a_growing_run() -> None:
    model = EngineModel(num_gpu_blocks=0, ms_per_kv_token=0.5)
    sched = Scheduler(model)
    for _ in range(4):
        sched.add(Sequence(1, 100))
    sched.complete(sched.schedule())
    step = sched.schedule()
    assert step is not None and step.pure_decode
    first = step.duration_ms
    for j in (1, 2, 7, 30):
        end = sched.run_ms(first, j)
        assert sched.steps_within(first, end - 1e-6) == j
        assert sched.steps_within(first, end + 1e-6) == j + 1


def test_the_presets_reproduce_the_published_latencies() -> None:
    with gzip.open(TRACES / "azure-llm-2023-conv.csv.gz", "rt") as f:
        rows = list(csv.reader(f))[1:5001]
    prompts, outputs = [int(r[1]) for r in rows], [int(r[2]) for r in rows]
    at = {c: calibration_itl_ms(LLAMA_70B_FP8_2XH100, c, prompts, outputs, requests=1500)
          for c in (1, 50, 100)}
    assert at[1] == pytest.approx(18.6, rel=0.03)
    assert at[50] == pytest.approx(59.7, rel=0.05)
    assert at[100] == pytest.approx(93.0, rel=0.12)
    small = {c: calibration_itl_ms(LLAMA_8B_1XH100, c, [256], [256], requests=600)
             for c in (1, 100, 250)}
    assert small[1] == pytest.approx(4.6, rel=0.03)
    assert small[100] == pytest.approx(7.6, rel=0.15)
    assert small[250] == pytest.approx(16.1, rel=0.15)


def test_bad_engine_settings_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs must be >= 1.*ms_per_token must be >= 0"):
        EngineModel(max_num_seqs=0, ms_per_token=-1.0)
