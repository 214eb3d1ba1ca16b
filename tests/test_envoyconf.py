import subprocess
from pathlib import Path

import pytest
import yaml
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingMode
from pydantic import ValidationError

from extproc import config
from extproc.gateway import envoyconf
from extproc_dev.stack import envoy_binary

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)

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


def test_bootstrap_is_built_from_typed_messages() -> None:
    """Every key rendered is a field of envoy-data-plane's messages (typed_configs included),
    and a value of the wrong type fails while rendering, not in Envoy."""
    c = config.from_mapping({"tracing": {"endpoint": "http://127.0.0.1:4317"}})
    doc = envoyconf.bootstrap(c, envoyconf.Topology(access_log=True,
                                                    backends=(("vllm.ns.svc", 8000),)))
    parsed = Bootstrap.from_dict(doc)
    assert parsed.static_resources is not None
    assert [cl.name for cl in parsed.static_resources.clusters] == ["inference", "extproc", "otel"]
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"]["failure_mode_alow"] = True  # a typo is rejected
    with pytest.raises(KeyError, match="failure_mode_alow"):
        Bootstrap.from_dict(doc)
    for bad_port in ("http", -1, 1.5):  # a plain dict would have rendered each of these
        with pytest.raises(ValidationError):
            envoyconf.bootstrap(c, envoyconf.Topology(listen_port=bad_port))  # type: ignore[arg-type]


def test_explicit_defaults_name_real_fields() -> None:
    doc = envoyconf._Doc()
    mode = ProcessingMode()
    assert doc.json(doc.explicit(mode, "response_body_mode")) == {"response_body_mode": "NONE"}
    with pytest.raises(AttributeError):
        doc.explicit(mode, "response_body_mod")


@pytest.mark.parametrize("argv", [
    [], ["--workers", "3"], ["--fail-closed"]], ids=["one", "workers", "fail-closed"])
def test_every_rendered_processor_cluster_is_health_checked_and_ejects_the_dead(
        tmp_path: Path, argv: list[str]) -> None:
    """What ``extproc envoy-config`` writes (and the chart's init container runs): gRPC health
    checks of each processor on the service the server turns NOT_SERVING when it drains, and
    ejection of a host whose connections fail, so a dead worker stops getting streams."""
    out = tmp_path / "envoy.yaml"
    done = subprocess.run([str(Path(envoy_binary()).parent / "extproc"), "envoy-config",
                           "-o", str(out), *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = yaml.safe_load(out.read_text())
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc")
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert len(hosts) == (3 if "--workers" in argv else 1)
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {}  # service "": NOT_SERVING while draining
    assert check["interval"] == "0.500s" and check["unhealthy_threshold"] == 2
    outlier = cluster["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] is True
    assert outlier["consecutive_local_origin_failure"] == 2
    assert outlier["max_ejection_percent"] == 50
