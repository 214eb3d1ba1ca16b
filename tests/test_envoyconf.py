import subprocess
from pathlib import Path

import yaml

from extproc import config, envoyconf
from extproc.stack import envoy_binary

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_bootstrap_matches_the_renderer() -> None:
    """envoy/envoy.yaml is generated: `extproc envoy-config -o envoy/envoy.yaml`."""
    rendered = envoyconf.render(config.from_mapping({}), envoyconf.Topology())
    assert (ROOT / "envoy" / "envoy.yaml").read_text() == rendered


def test_rendered_bootstrap_passes_envoy_validate(tmp_path: Path) -> None:
    c = config.from_mapping({"max_body_bytes": 1024})
    for fail_open in (True, False):
        path = tmp_path / f"envoy-{fail_open}.yaml"
        path.write_text(envoyconf.render(c, envoyconf.Topology(fail_open=fail_open)))
        result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_bootstrap_matches_what_the_server_expects() -> None:
    c = config.from_mapping({"max_body_bytes": 4096})
    doc = yaml.safe_load(envoyconf.render(c, envoyconf.Topology(fail_open=False)))
    listener = doc["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] > 4096
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext = hcm["http_filters"][0]["typed_config"]
    mode = ext["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SEND",
                                                                       "BUFFERED_PARTIAL")
    assert mode["response_header_mode"] == "SKIP" and mode["response_body_mode"] == "NONE"
    assert ext["allow_mode_override"] is True
    assert ext["failure_mode_allow"] is False
    assert ext["message_timeout"] == "2s"
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert clusters["extproc"]["circuit_breakers"]["thresholds"][0]["max_requests"] >= 100_000
