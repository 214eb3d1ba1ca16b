"""A pool's output lengths (extproc.decision.lengths): the prior, learning, censoring,
forgetting."""

import math
import random

import pytest

from extproc.decision.lengths import PRIOR_SAMPLES, Lengths, Prior, decay_factor


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


def test_answers_in_flight_are_counted_so_short_ones_ending_first_do_not_fool_it() -> None:
    # Bimodal answers: 75% of ~15 tokens, 25% of ~1,400. A few seconds after a start only the
    # short ones have ended; the long ones are in flight, each at least a few hundred tokens
    # in. Completions alone say answers are short (a mean of 15 against the true ~400); with
    # the ones in flight as censored observations it is back within a factor of two (it knows
    # only that they are at least that long: the prior's tail says how much longer).
    rng = random.Random(5)
    short = lognormal(rng, 750, math.log(15), 0.4)
    long = lognormal(rng, 250, math.log(1400), 0.4)
    true_mean = (sum(short) + sum(long)) / 1000
    ended = Lengths()
    for v in short:
        ended.observe(v)
    so_far = [min(v, rng.uniform(200, 600)) for v in long]  # none has ended yet
    assert ended.mean() < 0.2 * true_mean
    view = ended.censored(so_far)
    assert 0.5 * true_mean < view.mean() < true_mean
    assert view.quantile(0.9) > 400
    assert ended.mean() < 0.2 * true_mean  # the view is a copy: the histogram is unchanged
    assert ended.censored([]).mean() == pytest.approx(ended.mean())


def test_what_requests_in_flight_hold_is_length_biased() -> None:
    rng = random.Random(6)
    constant, bimodal = Lengths(), Lengths()
    for _ in range(20_000):
        constant.observe(rng.uniform(95, 105))
        bimodal.observe(15 if rng.random() < 0.75 else 1400)
    # all alike: half the final length on average (E[o^2] / 2E[o] = o / 2)
    assert constant.held() == pytest.approx(50.0, rel=0.05)
    # heavy-tailed: in flight are mostly the long ones, far above the mean (~361)
    assert bimodal.mean() == pytest.approx(361, rel=0.05)
    assert bimodal.held() == pytest.approx((0.75 * 15**2 + 0.25 * 1400**2) / (2 * 361), rel=0.1)
    assert bimodal.held(cap=100) <= 50.0  # max_tokens caps it like the mean
