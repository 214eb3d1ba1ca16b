"""Metric children found again without prometheus_client's per-call work
(extproc.observability.metrics)."""

from extproc.observability.metrics import Metrics


def test_a_label_child_is_remembered_and_still_exported() -> None:
    metrics = Metrics()
    first = metrics.prompt_counts.labels("llama", "counted")
    assert metrics.prompt_counts.labels("llama", "counted") is first
    assert metrics.prompt_counts.labels(pool="llama", how="counted") is first
    first.inc()
    metrics.prompt_counts.labels("llama", "counted").inc()
    metrics.prompt_counts.labels("other", "cached").inc(3)
    text = metrics.render().decode()
    assert 'extproc_prompt_token_counts_total{how="counted",pool="llama"} 2.0' in text
    assert 'extproc_prompt_token_counts_total{how="cached",pool="other"} 3.0' in text


def test_the_measured_level_is_scraped_in_seconds_per_replica() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from extproc.decision.learning import PoolLearning

    metrics = Metrics()
    learning = PoolLearning()
    metrics.watch_learning("llama", learning)
    learning.level.completed(at_ms=4000.0, level_ms=0.0, step_ms=1000.0)
    text = metrics.render().decode()
    value = {s.labels["pool"]: s.value for f in text_string_to_metric_families(text)
             for s in f.samples if s.name == "extproc_measured_level_seconds"}
    assert value == {"llama": 5.0}  # a hit at 4 s of work supports one request (1 s) more
