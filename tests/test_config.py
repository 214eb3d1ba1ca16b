from pathlib import Path

import pytest

from extproc import config
from extproc.config import Api, Infeasible, Mode
from extproc.errors import ConfigError


def test_defaults_build_a_usable_config() -> None:
    c = config.from_mapping({})
    assert c.mode is Mode.ENFORCE
    assert c.infeasible is Infeasible.PASS
    assert c.max_body_bytes == 8 * 1024 * 1024
    assert [p.name for p in c.pools] == ["default"]
    assert c.classes["latency"].ttft_ms == 2000
    assert c.classes["throughput"].ttft_ms is None
    route = c.route("/v1/chat/completions?x=1")
    assert route is not None and route.api is Api.OPENAI_CHAT
    assert c.route("/v1/models") is None


def test_every_problem_is_reported_at_once_naming_its_key() -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({
            "mode": "loud",
            "max_body_bytes": -1,
            "classes": {"latency": {"safety_factor": 1.5}},
            "pools": [{"name": "a", "replicas": True, "colour": "red"}],
            "routes": [{"path": "v1/chat", "class": "gold"}],
            "typo_key": 1,
        })
    text = "\n".join(err.value.problems)
    assert "mode: must be one of 'enforce', 'shadow'" in text
    assert "max_body_bytes: must be > 0 (got -1)" in text
    assert "classes.latency.safety_factor: must be in (0, 1] (got 1.5)" in text
    assert "pools[0].replicas: must be a number, not a boolean" in text
    assert "pools[0].colour: unknown key" in text
    assert "routes[0].path: must start with '/'" in text
    assert "routes[0].class: must be one of ['latency', 'throughput']" in text
    assert "typo_key: unknown key" in text
    assert len(err.value.problems) == 8


def test_missing_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pools\[0\].tokenizer: no such file"):
        config.from_mapping({"pools": [{"name": "a", "tokenizer": str(tmp_path / "nope")}]})


def test_keys_of_the_first_cost_model_say_where_they_went() -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"pools": [{"name": "a", "max_running": 8, "replicas": -1}]})
    assert err.value.problems == [
        "pools[0].max_running: moved to engine.max_num_seqs (see extproc.fleet.engine)",
        "pools[0].replicas: must be >= 0 (got -1)"]


def test_duplicate_pool_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="duplicate name 'a'"):
        config.from_mapping({"pools": [{"name": "a"}, {"name": "a"}]})


def test_pool_for_prefers_exact_model_then_wildcard() -> None:
    c = config.from_mapping({"pools": [
        {"name": "small", "models": ["llama-8b"]},
        {"name": "big", "models": ["*"]},
    ]})
    assert c.pool_for("llama-8b").name == "small"  # type: ignore[union-attr]
    assert c.pool_for("anything").name == "big"  # type: ignore[union-attr]
    only = config.from_mapping({"pools": [{"name": "small", "models": ["llama-8b"]}]})
    assert only.pool_for("other") is None


def test_load_reads_yaml_and_reports_bad_yaml(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("mode: shadow\npools:\n  - name: p\n    replicas: 3\n")
    c = config.load(good)
    assert c.mode is Mode.SHADOW and c.pools[0].replicas == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.yaml")
