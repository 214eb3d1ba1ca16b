"""The simulator's small parts: the HPA baseline, the SDK-like clients, the output predictor."""

import random

import pytest

from extproc.config import Pool
from extproc.estimate import ChargeInFull, Configured, Observed, cost_of, predictor_for
from extproc.sim.autoscaler import HpaUtilization, Observation
from extproc.sim.clients import ClientModel


def obs(now: float, ready: int, load: float, starting: int = 0) -> Observation:
    return Observation(now_s=now, window_s=15.0, ready=ready, starting=starting, draining=0,
                       arrivals=0, admitted=0, rejected=0, completed=0, good=0, load=load,
                       utilization=load / ready if ready else 0.0, occupancy=0.0, busy=1.0,
                       waiting=0, oldest_waiting_s=0.0, inflight=0, oldest_inflight_s=0.0)


def test_hpa_asks_for_load_over_target_and_counts_what_is_starting() -> None:
    hpa = HpaUtilization(target=0.75, min_replicas=12, max_replicas=24)
    assert hpa.recommend(obs(0, 12, 12.0)) == 16  # saturated: 12 / 0.75
    assert hpa.recommend(obs(15, 12, 12.0, starting=4)) == 16  # already requested
    assert hpa.recommend(obs(600, 16, 11.0)) == 16  # 11 / (16 x 0.75) = 0.92: tolerated
    assert hpa.recommend(obs(615, 16, 16.0)) == 22
    assert hpa.recommend(obs(630, 22, 22.0)) == 24  # capped at max


def test_hpa_scales_down_only_after_its_stabilization_window() -> None:
    hpa = HpaUtilization(target=0.75, min_replicas=2, max_replicas=24, scale_down_window_s=300)
    assert hpa.recommend(obs(0, 16, 12.0)) == 16
    assert hpa.recommend(obs(100, 16, 3.0)) == 16  # the window still remembers 16
    assert hpa.recommend(obs(301, 16, 3.0)) == 4


def test_clients_honor_retry_after_within_the_sdk_limit() -> None:
    client = ClientModel()
    rng = random.Random(0)
    assert client.after_429_s(4.0, 0, rng) == 4.0
    waited = client.after_429_s(90.0, 1, rng)  # beyond 60 s the SDK uses its own backoff
    assert 0.75 <= waited <= 1.0
    assert all(0.5 * 0.75 <= client.backoff_s(0, rng) <= 0.5 for _ in range(100))
    assert client.backoff_s(10, rng) <= 8.0


def test_observed_predicts_mean_and_tail_once_it_has_seen_enough() -> None:
    fallback = Configured(100.0, 300.0)
    seen = Observed(fallback=fallback, min_samples=50)
    assert seen.predict(10, 512) == (100.0, 300.0)  # too few samples yet
    rng = random.Random(1)
    values = [rng.lognormvariate(5.0, 0.8) for _ in range(20_000)]
    for v in values:
        seen.observe(v)
    mean, p99 = seen.predict(10, 512)
    assert mean == pytest.approx(sum(values) / len(values), rel=0.02)
    assert p99 == pytest.approx(sorted(values)[int(0.99 * len(values))], rel=0.1)


def test_observed_forgets_as_it_decays() -> None:
    seen = Observed(min_samples=10)
    for _ in range(1000):
        seen.observe(10)
    seen.decay(0.01)
    for _ in range(1000):
        seen.observe(1000)
    mean, _ = seen.predict(0, 5000)
    assert mean is not None and mean > 950


def test_a_pool_without_statistics_charges_max_tokens_in_full() -> None:
    assert isinstance(predictor_for(Pool(name="p")), ChargeInFull)
    cost = cost_of(100, None, 2, Pool(name="p", default_max_tokens=300))
    assert (cost.output_tokens, cost.typical_tokens, cost.long_tokens) == (600, 600, 600)
    pool = Pool(name="p", expected_output_tokens=120.0, long_output_tokens=700.0)
    cost = cost_of(100, 1000, 1, pool)
    assert (cost.typical_tokens, cost.long_tokens) == (120.0, 700.0)
    assert cost_of(100, 50, 1, pool).long_tokens == 50  # never above max_tokens
