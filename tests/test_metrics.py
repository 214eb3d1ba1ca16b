"""Metric children found again without prometheus_client's per-call work (extproc.metrics)."""

from extproc.metrics import Metrics


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
