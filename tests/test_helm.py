"""The Helm chart (helm/extproc): lint, render, Kubernetes schemas, values schema, and the
Envoy config the pod would really run.

Helm installs itself (tests/helm_tool.py). The Envoy check does what the pod does: it lays out
the files each container's volumes would hold (the ConfigMap's config, the Secret's password,
placeholder tokenizer files on the user's volume) under a temporary root, runs the init
container's exact command (`extproc envoy-config ...`, paths mapped into that root), then
validates the result with the Envoy container's exact arguments plus `--mode validate`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import config as config_mod
from extproc_dev.stack import envoy_binary, free_port
from tests import helm_tool
from tests.helm_tool import CHART, ROOT

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)

VALUE_SETS: dict[str, tuple[Path, ...]] = {
    "default": (),
    "all-on": (CHART / "ci" / "all-on-values.yaml",),
    "hpa-external-redis": (CHART / "ci" / "hpa-external-redis-values.yaml",),
    "unix-socket": (CHART / "ci" / "unix-socket-values.yaml",),
}
CASES = list(VALUE_SETS)


@pytest.fixture(scope="session", autouse=True)
def helm_binary() -> Path:
    try:
        return helm_tool.ensure_helm()
    except helm_tool.HelmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@cache
def rendered(case: str) -> tuple[dict[str, Any], ...]:
    return tuple(helm_tool.template(values=VALUE_SETS[case]))


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, got {len(hits)}"
    return hits[0]


def kinds(docs: tuple[dict[str, Any], ...]) -> set[str]:
    return {d["kind"] for d in docs}


def gateway_pod(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "Deployment", "gw-extproc")["spec"]["template"]["spec"]
    return spec


def container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    items = pod["initContainers" if init else "containers"]
    return next(c for c in items if c["name"] == name)


def workloads(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


# --- lint and render ----------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(case: str) -> None:
    done = helm_tool.helm("lint", "--strict", str(CHART),
                          *helm_tool.values_args(VALUE_SETS[case]), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_default_values_render_the_gateway_only() -> None:
    docs = rendered("default")
    assert kinds(docs) == {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role",
                           "RoleBinding", "PodDisruptionBudget", "Pod"}  # Pod: `helm test`
    pod = gateway_pod(docs)
    assert [c["name"] for c in pod["containers"]] == ["envoy", "extproc"]
    assert [c["name"] for c in pod["initContainers"]] == ["envoy-config"]
    assert container(pod, "envoy")["image"] == "envoyproxy/envoy:v1.40.0"
    # what `make image` tags, at the chart's appVersion
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    tagged = subprocess.run(["make", "-s", "image-name"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    assert tagged == f"envoy-llm-admission:{app_version}"
    for c in (container(pod, "extproc"), container(pod, "envoy-config", init=True)):
        assert c["image"] == tagged
    service = find(docs, "Service", "gw-extproc")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        "http": "http", "metrics": "metrics"}
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    assert cfg["listen"] == "0.0.0.0:50051" and cfg["metrics_listen"] == "0.0.0.0:9464"
    assert "ledger" in cfg and "kind" not in cfg["ledger"]  # in-process ledger


def test_all_on_renders_every_optional_part() -> None:
    docs = rendered("all-on")
    assert {"ScaledObject", "ServiceMonitor", "NetworkPolicy", "StatefulSet", "Secret",
            "PodDisruptionBudget", "Role", "RoleBinding"} <= kinds(docs)
    find(docs, "Deployment", "gw-extproc-jaeger")
    find(docs, "Service", "gw-extproc-jaeger")
    dashboard = find(docs, "ConfigMap", "gw-extproc-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # RBAC in the release namespace and in the inference namespace
    assert sorted(r["metadata"]["namespace"] for r in docs if r["kind"] == "Role") == [
        "inference", "llm"]
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    assert cfg["ledger"]["kind"] == "redis"
    assert cfg["ledger"]["url"] == "redis://gw-extproc-redis:6379/0"
    assert cfg["tracing"]["endpoint"] == "http://gw-extproc-jaeger.llm.svc:4317"
    assert cfg["mode"] == "shadow" and cfg["infeasible"] == "reject"


@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_pass_kubernetes_schemas(case: str) -> None:
    """Built-in kinds: kubernetes-validate, strict, at the chart's floor and the newest
    version; ScaledObject and ServiceMonitor (CRDs): helm_tool's structural schemas."""
    problems = [p for doc in rendered(case) for p in helm_tool.schema_problems(doc)]
    assert not problems, "\n".join(problems)


def test_crd_schemas_catch_mistakes() -> None:
    """The two hand-written CRD schemas are not rubber stamps."""
    scaled = dict(find(rendered("all-on"), "ScaledObject"))
    scaled["spec"] = {**scaled["spec"], "triggers": [{"type": "external",
                                                      "metadata": {"pool": 3}}]}
    assert any("metadata.pool" in p for p in helm_tool.schema_problems(scaled))
    monitor = dict(find(rendered("all-on"), "ServiceMonitor"))
    monitor["spec"] = {"endpoints": [{"port": "metrics", "interval": "15 seconds"}]}
    problems = helm_tool.schema_problems(monitor)
    assert any("selector" in p for p in problems) and any("interval" in p for p in problems)


# --- values.schema.json and the template's own checks --------------------------------------

BAD_VALUES = [
    ("replicaCount: -1", "/replicaCount", "minimum"),
    ("replicaCount: two", "/replicaCount", "want integer"),
    ("config: {mode: fast}", "/config/mode", "'enforce', 'shadow'"),
    ("config: {infeasible: drop}", "/config/infeasible", "'pass', 'reject'"),
    ("envoy: {port: http}", "/envoy/port", "want integer"),
    ("config: {pools: []}", "/config/pools", "minItems"),
    ("config: {pools: [{name: ''}]}", "/config/pools/0/name", "minLength"),
    ("config: {pools: [{name: a, replicas: -2}]}", "/config/pools/0/replicas", "minimum"),
    ("config: {pools: [{name: a, engine_metrics: {min_coverage: 2}}]}",
     "/config/pools/0/engine_metrics/min_coverage", "maximum"),
    ("config: {classes: {latency: {safety_factor: 1.5}}}", "/config/classes/latency/safety_factor",
     "maximum"),
    ("config: {retry_after: {max_s: 600}}", "/config/retry_after/max_s", "maximum"),
    ("config: {typo_key: 1}", "/config", "'typo_key' not allowed"),
    ("redis: {mode: cluster}", "/redis/mode", "'none', 'bundled', 'external'"),
    ("autoscaling: {mode: vpa}", "/autoscaling/mode", "'none', 'keda', 'hpa'"),
    ("extproc: {transport: pipe}", "/extproc/transport", "'tcp', 'unix'"),
    ("allowPerPodLedger: yes-please", "/allowPerPodLedger", "want boolean"),
    ("backend: {host: ''}", "/backend/host", "minLength"),
    ("tokenizer: {source: s3}", "/tokenizer/source", "'none', 'pvc'"),
]


@pytest.mark.parametrize(("values", "field", "message"), BAD_VALUES,
                         ids=[v for v, _, _ in BAD_VALUES])
def test_values_schema_rejects_bad_values(values: str, field: str, message: str,
                                          tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(values + "\n")
    error = helm_tool.template_error(values=(path,))
    assert f"at '{field}'" in error and message in error, error


BAD_COMBINATIONS = [
    ("config: {pools: [{name: a, tokenizer: /models/tokenizer/t.json}]}",
     "config.pools[0].tokenizer: set tokenizer.source"),
    ("{tokenizer: {source: pvc, pvc: {claimName: c}},"
     " config: {pools: [{name: a, tokenizer: /elsewhere/t.json}]}}",
     "config.pools[0].tokenizer: must be a file under tokenizer.mountPath"),
    ("tokenizer: {source: pvc}", "tokenizer.pvc.claimName: required"),
    ("config: {pools: [{name: a}, {replicas: 2}]}",
     "config.pools[1].name: required (only pools[0] may leave it out"),
    ("replicaCount: 2",
     "replicaCount: must be 1 with the in-process ledger (redis.mode none)"),
    ("config: {listen: '0.0.0.0:1'}", "config.listen: set by the chart"),
    ("config: {ledger: {url: 'redis://x:6379'}}", "config.ledger.url: the chart sets"),
    ("redis: {mode: external}", "redis.external.url: required"),
    ("tracing: {enabled: true}", "tracing.endpoint: required"),
    ("autoscaling: {mode: keda, target: {name: vllm}, pool: nope}",
     "autoscaling.pool: must name one of config.pools (default) (got nope)"),
    ("autoscaling: {mode: hpa}", "autoscaling.target.name: required"),
    ("{autoscaling: {mode: hpa, target: {name: v}, minReplicas: 5, maxReplicas: 2}}",
     "autoscaling.maxReplicas: must be >= autoscaling.minReplicas (5) (got 2)"),
    ("{autoscaling: {mode: hpa, target: {name: v}, minReplicas: 0}}",
     "autoscaling.minReplicas: must be >= 1 with autoscaling.mode hpa"),
    ("terminationGracePeriodSeconds: 20",
     "terminationGracePeriodSeconds: must be > extproc.preStopSleepSeconds + config.drain_grace_s"
     " (30)"),
    ("extproc: {livenessProbe: {periodSeconds: 5, failureThreshold: 3}}",
     "extproc.livenessProbe: periodSeconds x failureThreshold (15) must exceed"
     " config.drain_grace_s (25)"),
]


@pytest.mark.parametrize(("values", "message"), BAD_COMBINATIONS,
                         ids=[m.split(":")[0] for _, m in BAD_COMBINATIONS])
def test_template_refuses_inconsistent_values(values: str, message: str,
                                              tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(values + "\n")
    error = helm_tool.template_error(values=(path,))
    assert message in error, error


# --- gateway replicas and the ledger they share --------------------------------------------

def _replicas(docs: tuple[dict[str, Any], ...]) -> int:
    replicas: int = find(docs, "Deployment", "gw-extproc")["spec"]["replicas"]
    return replicas


def test_default_values_run_one_gateway_replica_with_the_in_process_ledger() -> None:
    """Each pod's in-process ledger sees the whole fleet's capacity: one pod is exact."""
    docs = rendered("default")
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    assert "kind" not in cfg["ledger"]
    assert _replicas(docs) == 1


def test_more_gateway_replicas_with_the_in_process_ledger_name_the_keys_to_set() -> None:
    error = helm_tool.template_error(sets=("replicaCount=3",))
    assert "(got 3)" in error and "3x" in error, error
    for key in ("redis.mode bundled", "redis.external.url", "allowPerPodLedger"):
        assert key in error, (key, error)


@pytest.mark.parametrize("ledger", [
    ("redis.mode=bundled",),
    ("redis.mode=external", "redis.external.url=redis://redis.cache:6379/0"),
], ids=["bundled", "external"])
def test_any_gateway_replica_count_renders_with_the_redis_ledger(ledger: tuple[str, ...]) -> None:
    docs = tuple(helm_tool.template(sets=("replicaCount=5", *ledger)))
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    assert cfg["ledger"]["kind"] == "redis"
    assert _replicas(docs) == 5


def test_per_pod_ledgers_render_only_when_asked_for_and_the_notes_warn() -> None:
    sets = ("--set", "replicaCount=2", "--set", "allowPerPodLedger=true")
    done = helm_tool.helm("install", "gw", str(CHART), "--dry-run=client", "-n", "llm", *sets)
    manifest, notes = done.stdout.split("NOTES:", 1)
    docs = tuple(d for d in yaml.safe_load_all(manifest.split("MANIFEST:", 1)[1]) if d)
    assert _replicas(docs) == 2
    assert "over-admitted 2x" in notes and "allowPerPodLedger" in notes


# --- config.pools: Helm replaces a list wholesale ------------------------------------------

def _pools(*sets: str, values: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    docs = tuple(helm_tool.template(values=values, sets=sets))
    pools: list[dict[str, Any]] = yaml.safe_load(
        find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])["pools"]
    return pools


def test_setting_one_key_of_pools_0_keeps_the_default_pool() -> None:
    pools = _pools("config.pools[0].replicas=3")
    assert pools == [{"name": "default", "models": ["*"], "replicas": 3}]
    assert config_mod.from_mapping({"pools": pools}).pools[0].replicas == 3  # the sidecar's view
    [pool] = _pools("config.pools[0].engine.max_num_seqs=256", "autoscaling.mode=keda",
                    "autoscaling.target.name=vllm")  # autoscaling.pool's default finds it
    assert pool == {"name": "default", "models": ["*"], "engine": {"max_num_seqs": 256}}


def test_the_default_pool_shows_only_what_extproc_assumes_for_a_bare_pool() -> None:
    """A nameless pools[0] gets the default pool's name and models; every other key it leaves
    out takes extproc's own default, so it must be what values.yaml shows for the default pool
    (an override by --set loses nothing)."""
    [shown] = yaml.safe_load((CHART / "values.yaml").read_text())["config"]["pools"]
    bare = {"name": "default", "models": ["*"]}
    assert config_mod.from_mapping({"pools": [shown]}).pools == config_mod.from_mapping(
        {"pools": [bare]}).pools


def test_a_full_pools_list_in_a_values_file_renders_as_written() -> None:
    path = CHART / "ci" / "all-on-values.yaml"
    written = yaml.safe_load(path.read_text())["config"]["pools"]
    assert _pools("replicaCount=1", values=(path,)) == written


_CHART_OWNED = {"listen", "metrics_listen", "tracing", "keda_listen"}
_LEDGER_CONNECTION = {"kind", "url", "username", "password", "password_file", "password_env"}


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def test_values_schema_knows_every_key_extproc_reads() -> None:
    """values.schema.json refuses unknown config keys, so it must track extproc/config/:
    a key added there (or here) without the other fails this test."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    cfg = schema["properties"]["config"]["properties"]
    assert set(cfg) - {"listen", "metrics_listen"} == _names(config_mod.Config) - _CHART_OWNED
    pool = cfg["pools"]["items"]["properties"]
    assert set(pool) == _names(config_mod.Pool)
    assert set(pool["engine_metrics"]["properties"]) == _names(config_mod.EngineMetricsConfig)
    cls = cfg["classes"]["additionalProperties"]["properties"]
    assert set(cls) == _names(config_mod.ClassPolicy) - {"name"}
    route = cfg["routes"]["items"]["properties"]
    assert set(route) == (_names(config_mod.Route) - {"service_class"}) | {"class"}
    assert set(route["api"]["enum"]) == {a.value for a in config_mod.Api}
    assert set(cfg["mode"]["enum"]) == {m.value for m in config_mod.Mode}
    assert set(cfg["infeasible"]["enum"]) == {m.value for m in config_mod.Infeasible}
    ledger = cfg["ledger"]["properties"]
    assert set(ledger) - _LEDGER_CONNECTION == _names(config_mod.LedgerConfig) - _LEDGER_CONNECTION
    assert set(ledger["tls"]["properties"]) == _names(config_mod.RedisTls)
    assert set(ledger["sentinel"]["properties"]) == _names(config_mod.RedisSentinel)
    assert set(ledger["breaker"]["properties"]) == _names(config_mod.BreakerConfig)
    assert set(ledger["on_unavailable"]["enum"]) == {m.value for m in config_mod.OnUnavailable}
    assert set(cfg["retry_after"]["properties"]) == _names(config_mod.RetryAfter)


# --- the pod: security, probes, termination ------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_every_container_is_locked_down_and_sized(case: str) -> None:
    for workload in workloads(rendered(case)):
        pod = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{c['name']}"
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert c["resources"]["requests"]["memory"], where
            assert c["resources"]["requests"]["cpu"], where
            assert c["resources"]["limits"]["memory"], where


def test_probes_and_drain_match_the_sidecar() -> None:
    pod = gateway_pod(rendered("default"))
    extproc = container(pod, "extproc")
    assert extproc["readinessProbe"]["grpc"] == {
        "port": 50051, "service": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert extproc["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    envoy = container(pod, "envoy")
    assert envoy["readinessProbe"]["exec"]["command"][-1] == "ready"
    assert envoy["lifecycle"]["preStop"]["exec"]["command"][-1] == "drain"
    env = {e["name"]: e["value"] for e in envoy["env"]}
    assert env["ENVOY_ADMIN_PORT"] == "9901"
    # drain_grace_s 25 + the sidecar's 5 s preStop sleep: Envoy drains as long, and the
    # kubelet waits longer than both.
    assert extproc["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
    assert env["DRAIN_MAX_S"] == "30"
    assert envoy["args"][envoy["args"].index("--drain-time-s") + 1] == "30"
    assert pod["terminationGracePeriodSeconds"] > 30
    all_on = gateway_pod(rendered("all-on"))  # drain_grace_s 40, grace set to 60
    assert all_on["terminationGracePeriodSeconds"] == 60
    assert {e["name"]: e["value"] for e in container(all_on, "envoy")["env"]}[
        "DRAIN_MAX_S"] == "45"


def test_unix_socket_transport_shares_a_volume_and_probes_metrics() -> None:
    docs = rendered("unix-socket")
    pod = gateway_pod(docs)
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    assert cfg["listen"] == "unix:/var/run/extproc/extproc.sock"
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in pod["containers"]}
    assert mounts["envoy"]["socket"] == mounts["extproc"]["socket"] == "/var/run/extproc"
    assert container(pod, "extproc")["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container(pod, "extproc")["livenessProbe"]["httpGet"]["path"] == "/metrics"
    # one owner for the socket: both containers run as the pod's user
    assert all("runAsUser" not in c["securityContext"] for c in pod["containers"])


def test_scaled_object_and_hpa_point_at_our_signal() -> None:
    docs = rendered("all-on")
    scaled = find(docs, "ScaledObject")
    assert scaled["metadata"]["namespace"] == "inference"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "vllm-llama"
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "external-push"
    assert trigger["metadata"] == {"scalerAddress": "gw-extproc-scaler.llm.svc:9443",
                                   "pool": "llama"}
    scaler = find(docs, "Service", "gw-extproc-scaler")
    assert scaler["spec"]["ports"][0]["port"] == 9443
    ports = {p["name"] for p in container(gateway_pod(docs), "extproc")["ports"]}
    assert "keda-scaler" in ports
    hpa = find(rendered("hpa-external-redis"), "HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["External", "Object", "Pods"]


def test_network_policy_keeps_the_ext_proc_port_private() -> None:
    docs = rendered("all-on")
    policy = find(docs, "NetworkPolicy", "gw-extproc")
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert opened == {"http", "metrics", "keda-scaler"}
    redis = find(docs, "NetworkPolicy", "gw-extproc-redis")
    assert redis["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "gateway"


def test_rbac_reads_endpointslices_only() -> None:
    role = find(rendered("default"), "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]


def test_notes_say_how_to_reach_the_gateway_and_jaeger() -> None:
    done = helm_tool.helm("install", "gw", str(CHART), "--dry-run=client", "--namespace", "llm",
                          *helm_tool.values_args(VALUE_SETS["all-on"]))
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "http://gw-extproc.llm.svc:8000/v1/chat/completions" in notes
    assert "port-forward svc/gw-extproc-jaeger 16686:16686" in notes


# --- the dashboard ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exposed_metrics(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name a running ``extproc serve`` exposes on ``/metrics``: each family
    is listed (HELP and TYPE) even before its first sample; a counter as ``<name>_total``, a
    histogram as ``_bucket``, ``_sum`` and ``_count``."""
    from prometheus_client.parser import text_string_to_metric_families

    from extproc_dev.stack import free_port, wait_http

    grpc_port, metrics_port = free_port(), free_port()
    cfg = tmp_path_factory.mktemp("scrape") / "extproc.yaml"
    cfg.write_text(f"listen: 127.0.0.1:{grpc_port}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
                   f"keda_listen: 127.0.0.1:{free_port()}\nautoscale: {{window_s: 1}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_http(url, proc=proc)  # type: ignore[arg-type]
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count")}.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
        names.update(sample.name for sample in family.samples)
    assert "extproc_admission_decisions_total" in names  # a real scrape, not an empty page
    return names


def test_dashboard_queries_name_only_metrics_the_server_exposes(
        exposed_metrics: set[str]) -> None:
    dashboard = json.loads((CHART / "dashboards" / "extproc.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    titles = " / ".join(p["title"] for p in panels).lower()
    for topic in ("outcome", "reason", "reject ratio", "queue", "outstanding work",
                  "replicas", "recommendation"):
        assert topic in titles, topic
    missing = []
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"\b(extproc_[a-z_]+)", target["expr"])
            assert names, (panel["title"], target["expr"])
            missing += [(panel["title"], n) for n in names if n not in exposed_metrics]
    assert not missing, missing


def test_documented_metric_tables_name_only_exposed_metrics(exposed_metrics: set[str]) -> None:
    for doc in (ROOT / "docs" / "autoscaling.md", ROOT / "README.md"):
        rows = re.findall(r"^\| `(extproc_[a-z_]+)`", doc.read_text(), flags=re.MULTILINE)
        # a histogram is documented by its family name
        assert not [n for n in rows if n not in exposed_metrics
                    and f"{n}_bucket" not in exposed_metrics], doc.name


# --- the Envoy config the pod would run ----------------------------------------------------

_SECRET_PLACEHOLDER = "not-a-real-password\n"


class PodFiles:
    """The files a pod's containers would see, laid out under ``root``.

    Each volume is a folder under ``root/volumes``; a container's view is ``root/<name>``
    where each mountPath is a symlink to its volume (or the volume's subPath). Chart-made
    ConfigMaps and Secrets are filled from the rendered manifests; the user's volumes (PVC,
    hostPath, their ConfigMap) start empty and ``provide`` adds what the config expects there.
    """

    def __init__(self, root: Path, docs: tuple[dict[str, Any], ...], pod: dict[str, Any],
                 remap: Callable[[str, str], str] | None = None) -> None:
        self.root = root
        self.pod = pod
        self.user_volumes: set[str] = set()
        self._views: dict[str, Callable[[str], Path]] = {}
        configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for volume in pod["volumes"]:
            where = root / "volumes" / volume["name"]
            where.mkdir(parents=True)
            if "configMap" in volume and volume["configMap"]["name"] in configmaps:
                for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
                    (where / key).write_text(text)
            elif "secret" in volume:
                for item in volume["secret"]["items"]:
                    (where / item["path"]).write_text(_SECRET_PLACEHOLDER)
            elif "emptyDir" not in volume:
                self.user_volumes.add(volume["name"])

    def view(self, c: dict[str, Any]) -> Callable[[str], Path]:
        """Lay out container ``c``'s mounts; returns its path -> host path mapping."""
        if c["name"] in self._views:
            return self._views[c["name"]]
        base: Path = self.root / str(c["name"])
        mounts = sorted(c["volumeMounts"], key=lambda m: m["mountPath"])
        for m in mounts:
            link = base / m["mountPath"].lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(self.root / "volumes" / m["name"] / m.get("subPath", ""))

        def host(path: str) -> Path:
            mount = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")),
                         None)
            assert mount is not None, f"{c['name']}: {path} is on no volume it mounts"
            return base / path.lstrip("/")
        self._views[c["name"]] = host
        return host

    def provide(self, c: dict[str, Any], path: str) -> None:
        """A file the user's volume must hold (a tokenizer): create a placeholder."""
        mount = next(m for m in c["volumeMounts"]
                     if path.startswith(m["mountPath"].rstrip("/") + "/"))
        assert mount["name"] in self.user_volumes, (path, mount)
        rel = Path(path).relative_to(mount["mountPath"])
        target = self.root / "volumes" / mount["name"] / mount.get("subPath", "") / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("{}")


def _config_paths(cfg: dict[str, Any]) -> list[tuple[list[Any], str]]:
    """(key path, file path) of every file the extproc config names."""
    out: list[tuple[list[Any], str]] = []
    for i, pool in enumerate(cfg.get("pools", [])):
        if pool.get("tokenizer"):
            out.append((["pools", i, "tokenizer"], pool["tokenizer"]))
    ledger = cfg.get("ledger", {})
    if ledger.get("password_file"):
        out.append((["ledger", "password_file"], ledger["password_file"]))
    for key in ("ca_file", "cert_file", "key_file"):
        if ledger.get("tls", {}).get(key):
            out.append((["ledger", "tls", key], ledger["tls"][key]))
    return out


def _container_config(files: PodFiles, c: dict[str, Any], config_path: str) -> Path:
    """Rewrite container ``c``'s view of the config with host paths; returns its host path."""
    host = files.view(c)
    original = host(config_path)
    cfg = yaml.safe_load(original.read_text())
    for keys, path in _config_paths(cfg):
        host_path = host(path)
        if not host_path.exists():
            files.provide(c, path)
        node = cfg
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = str(host_path)
    mapped = files.root / f"{c['name']}-config.yaml"
    mapped.write_text(yaml.safe_dump(cfg))
    return mapped


def _arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("case", CASES)
def test_rendered_config_loads_in_the_sidecar(case: str, tmp_path: Path) -> None:
    """extproc's own validation accepts the ConfigMap as the sidecar would read it."""
    docs = rendered(case)
    pod = gateway_pod(docs)
    sidecar = container(pod, "extproc")
    files = PodFiles(tmp_path, docs, pod)
    mapped = _container_config(files, sidecar, _arg_after(sidecar["args"], "--config"))
    config_mod.load(mapped)  # raises ConfigError naming every bad key


@pytest.mark.parametrize("case", CASES)
def test_envoy_config_the_pod_renders_passes_envoy_validate(case: str, tmp_path: Path) -> None:
    docs = rendered(case)
    pod = gateway_pod(docs)
    init = container(pod, "envoy-config", init=True)
    envoy = container(pod, "envoy")
    files = PodFiles(tmp_path, docs, pod)
    assert init["command"] == ["extproc"]
    args = list(init["args"])
    host = files.view(init)
    config_path = _arg_after(args, "--config")
    args[args.index(config_path)] = str(_container_config(files, init, config_path))
    out = _arg_after(args, "--output")
    args[args.index(out)] = str(host(out))
    done = subprocess.run([str(Path(sys.executable).parent / "extproc"), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (
        f"the init container's command failed: extproc {' '.join(init['args'])}\n"
        f"{done.stderr[-3000:]}")

    # Envoy's exact arguments, its config path seen through its own mounts.
    envoy_host = files.view(envoy)
    envoy_args = list(envoy["args"])
    bootstrap = _arg_after(envoy_args, "-c")
    envoy_args[envoy_args.index(bootstrap)] = str(envoy_host(bootstrap))
    assert envoy["command"] == ["envoy"]
    done = subprocess.run([envoy_binary(), "--mode", "validate", *envoy_args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (
        "envoy --mode validate refused the bootstrap the init container rendered:\n"
        + (done.stdout + done.stderr)[-3000:])
    text = envoy_host(bootstrap).read_text()
    backend = f"{_arg_after(init['args'], '--backend').rpartition(':')[0]}"
    assert backend in text  # the inference Service's DNS name, resolved by Envoy


# --- the probe and preStop script against a real Envoy -------------------------------------

def test_envoy_admin_script_probes_and_drains_a_real_envoy(tmp_path: Path) -> None:
    script = CHART / "files" / "envoy-admin.sh"
    admin, listen = free_port(), free_port()
    bootstrap = tmp_path / "envoy.yaml"
    subprocess.run([str(Path(sys.executable).parent / "extproc"), "envoy-config",
                    "--port", str(listen), "--admin-port", str(admin), "-o", str(bootstrap)],
                   check=True, timeout=60)
    env = {"ENVOY_ADMIN_PORT": str(admin), "DRAIN_MIN_S": "0", "DRAIN_MAX_S": "5",
           "PATH": "/usr/bin:/bin"}

    def run(action: str) -> int:
        return subprocess.run(["bash", str(script), action], env=env, timeout=30,
                              capture_output=True).returncode

    assert run("ready") != 0  # nothing listening yet
    proc = subprocess.Popen([envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart",
                             "--log-level", "warn", "--base-id", str(admin)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while run("ready") != 0:
            assert proc.poll() is None, "envoy exited"
            assert time.monotonic() < deadline, "envoy never became ready"
            time.sleep(0.2)
        assert run("live") == 0
        started = time.monotonic()
        assert run("drain") == 0
        assert time.monotonic() - started < 4  # idle: no need to wait out DRAIN_MAX_S
        assert run("ready") != 0  # /ready answers 503 DRAINING
        assert run("live") == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- images, KEDA, `helm test`, the chart as a subchart --------------------------------------

def _sidecar_image(*sets: str) -> str:
    image: str = container(gateway_pod(tuple(helm_tool.template(sets=sets))), "extproc")["image"]
    return image


def test_image_reference_takes_registry_global_registry_tag_and_digest() -> None:
    digest = "sha256:" + "ab" * 32
    assert _sidecar_image("extproc.image.registry=reg.example/ml") == (
        "reg.example/ml/envoy-llm-admission:0.1.0")
    assert _sidecar_image("global.imageRegistry=mirror.example") == (
        "mirror.example/envoy-llm-admission:0.1.0")
    assert _sidecar_image("global.imageRegistry=mirror.example",
                          "extproc.image.registry=own.example") == (
        "own.example/envoy-llm-admission:0.1.0")
    assert _sidecar_image("extproc.image.tag=dev", f"extproc.image.digest={digest}") == (
        f"envoy-llm-admission:dev@{digest}")
    assert "/extproc/image/digest" in helm_tool.template_error(
        sets=("extproc.image.digest=latest",))


def test_keda_by_default_serves_the_scaler_it_points_at_with_a_fallback() -> None:
    docs = tuple(helm_tool.template(sets=("autoscaling.mode=keda",
                                          "autoscaling.target.name=vllm")))
    cfg = yaml.safe_load(find(docs, "ConfigMap", "gw-extproc")["data"]["config.yaml"])
    scaled = find(docs, "ScaledObject", "vllm")["spec"]
    address = scaled["triggers"][0]["metadata"]["scalerAddress"]
    port = int(address.rsplit(":", 1)[1])
    assert cfg["keda_listen"] == f"0.0.0.0:{port}"
    scaler = find(docs, "Service", "gw-extproc-scaler")
    assert address.startswith(scaler["metadata"]["name"] + ".")
    assert [p["port"] for p in scaler["spec"]["ports"]] == [port]
    assert port in [p["containerPort"] for p in container(gateway_pod(docs), "extproc")["ports"]]
    assert scaled["triggers"][0]["metricType"] == "AverageValue"  # a fallback needs it
    assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 1,
                                  "behavior": "currentReplicasIfHigher"}
    off = tuple(helm_tool.template(sets=("autoscaling.mode=keda", "autoscaling.target.name=vllm",
                                         "autoscaling.keda.fallback.enabled=false",
                                         "autoscaling.keda.writeListenKey=false")))
    assert "fallback" not in find(off, "ScaledObject", "vllm")["spec"]
    assert "keda_listen" not in yaml.safe_load(
        find(off, "ConfigMap", "gw-extproc")["data"]["config.yaml"])


def test_keda_notes_describe_what_is_served() -> None:
    sets = ("--set", "autoscaling.mode=keda", "--set", "autoscaling.target.name=vllm")
    notes = helm_tool.helm("install", "--dry-run", "gw", str(CHART), "-n", "llm",
                           *sets).stdout.split("NOTES:", 1)[1]
    assert "gw-extproc-scaler.llm.svc:9443 (keda_listen in the config)" in notes
    assert "not served yet" not in notes and "does not serve yet" not in notes


def test_helm_test_hook_sends_one_request_with_the_sidecar_image() -> None:
    docs = rendered("default")
    pod = find(docs, "Pod", "gw-extproc-test-request")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [c] = pod["spec"]["containers"]
    assert c["image"] == container(gateway_pod(docs), "extproc")["image"]
    assert "http://gw-extproc:8000/v1/chat/completions" in c["args"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # the script itself is valid Python
    compile(c["args"][0], "helm-test", "exec")


def test_the_chart_renders_as_a_subchart_of_an_umbrella(tmp_path: Path) -> None:
    # Helm hands every subchart `global`; the umbrella's values for the subchart sit under its
    # name. `helm dependency update` packs this chart from a file:// repository, as a user would.
    umbrella = tmp_path / "platform"
    (umbrella / "templates").mkdir(parents=True)
    (umbrella / "templates" / "team.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: team}\n"
        "data: {team: {{ .Values.global.team | quote }}}\n")
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "extproc", "version": "0.1.0",
                          "repository": f"file://{CHART}", "alias": "gateway"}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "mirror.example", "team": "ml-platform"},
        "gateway": {"backend": {"host": "vllm.inference"}, "replicaCount": 1}}))
    helm_tool.helm("dependency", "update", str(umbrella))
    done = helm_tool.helm("template", "plat", str(umbrella), "--namespace", "llm")
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "team"
                )["data"] == {"team": "ml-platform"}
    pod = gateway_pod_named(docs, "plat-gateway")
    assert container(pod, "extproc")["image"] == "mirror.example/envoy-llm-admission:0.1.0"
    assert container(pod, "envoy")["image"] == "mirror.example/envoyproxy/envoy:v1.40.0"
    lint = helm_tool.helm("lint", "--strict", str(umbrella), check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def gateway_pod_named(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    [deployment] = [d for d in docs if d["kind"] == "Deployment"
                    and d["metadata"]["name"] == name]
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec
