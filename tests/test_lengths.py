"""A pool's output lengths (extproc.lengths): the prior, learning, censoring, forgetting."""

import math
import random

import pytest

from extproc.lengths import PRIOR_SAMPLES, Lengths, Prior, decay_factor


def lognormal(rng: random.Random, n: int, mu: float, sigma: float) -> list[float]:
    return [rng.lognormvariate(mu, sigma) for _ in range(n)]


def test_the_prior_is_a_lognormal_with_the_configured_mean_and_p99() -> None:
    lengths = Lengths(Prior(mean=300.0, p99=2000.0))
    assert lengths.mean() == pytest.approx(300.0, rel=0.05)
    assert lengths.quantile(0.99) == pytest.approx(2000.0, rel=0.1)
    assert lengths.seen == 0


def test_a_fresh_pool_is_never_a_cliff_it_prices_like_its_prior() -> None:
    lengths = Lengths()  # the default chat prior
    assert 200 < lengths.mean() < 320
    assert lengths.mean(cap=64) <= 64  # a small max_tokens caps the typical length


def test_the_learned_mean_and_tail_follow_the_outputs_and_the_prior_fades() -> None:
    rng = random.Random(1)
    values = lognormal(rng, 20_000, 3.0, 0.8)  # median 20, far from the prior's 159
    lengths = Lengths()
    for v in values:
        lengths.observe(v)
    ordered = sorted(values)
    assert lengths.mean() == pytest.approx(sum(values) / len(values), rel=0.03)
    assert lengths.quantile(0.99) == pytest.approx(ordered[int(0.99 * len(values))], rel=0.1)
    assert lengths.quantile(0.5) == pytest.approx(ordered[len(values) // 2], rel=0.1)
    assert lengths.survival(ordered[int(0.9 * len(values))]) == pytest.approx(0.1, abs=0.01)


def test_outputs_cut_at_max_tokens_are_not_taken_for_their_length() -> None:
    # The true lengths have median 200; half the clients send max_tokens 50, so their answers
    # are cut there. Counted as 50-token answers, the mean would fall to ~140; redistributed
    # to the right of 50 (Kaplan-Meier) it stays near the truth.
    rng = random.Random(2)
    truth = lognormal(rng, 20_000, math.log(200), 0.7)
    naive, censored = Lengths(), Lengths()
    for i, v in enumerate(truth):
        cut = i % 2 == 0 and v > 50
        seen = 50.0 if cut else v
        naive.observe(seen)
        censored.observe(seen, cut=cut)
    true_mean = sum(truth) / len(truth)
    assert naive.mean() < 0.8 * true_mean
    assert censored.mean() == pytest.approx(true_mean, rel=0.06)
    ordered = sorted(truth)
    assert censored.quantile(0.99) == pytest.approx(ordered[int(0.99 * len(truth))], rel=0.15)


def test_forgetting_follows_a_change_of_traffic() -> None:
    lengths = Lengths()
    for _ in range(1000):
        lengths.observe(10)
    lengths.decay(0.01)
    for _ in range(1000):
        lengths.observe(1000)
    assert lengths.mean() > 900
    assert decay_factor(10.0) == pytest.approx(0.99)
    assert decay_factor(1.0) ** 10 == pytest.approx(decay_factor(10.0))


def test_the_prior_keeps_its_weight_when_everything_else_is_forgotten() -> None:
    lengths = Lengths(Prior(mean=100.0, p99=500.0))
    for _ in range(500):
        lengths.observe(2000)
    assert lengths.mean() > 1500
    lengths.decay(0.0)
    assert lengths.mean() == pytest.approx(100.0, rel=0.05)
    assert lengths.seen == 0 and PRIOR_SAMPLES > 0


def test_an_engine_bucket_is_spread_over_the_cells_inside_it() -> None:
    lengths = Lengths(Prior(mean=30.0, p99=40.0))
    lengths.observe_bucket(20.0, 50.0, 10_000.0)  # vLLM's 20-50 bucket
    assert 20 < lengths.quantile(0.05) < lengths.quantile(0.5) < lengths.quantile(0.95) <= 50
    top = Lengths()
    top.observe_bucket(20_000.0, math.inf, 10_000.0)  # beyond every bound: the top cell
    assert top.quantile(0.9) > 20_000
    before = top.mean()
    top.observe_bucket(5.0, 5.0, 0.0)  # nothing: no change
    assert top.mean() == before


def test_a_bad_prior_still_gives_a_usable_distribution() -> None:
    wide = Prior(mean=10.0, p99=1e6)  # beyond any log-normal: the widest one
    assert 0 < wide.sigma() <= 2.33
    narrow = Prior(mean=100.0, p99=50.0)  # p99 under the mean: nearly a point
    lengths = Lengths(narrow)
    assert lengths.quantile(0.99) == pytest.approx(100.0, rel=0.5)
