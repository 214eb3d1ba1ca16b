"""Transport security of the processor: mutual TLS on its gRPC listener (certificates reloaded
from disk without a restart) and a Unix socket, each proven with real gRPC clients, with
OpenSSL clients reading the served certificate, and with real Envoy in front."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import config
from extproc.config import ServerTls
from extproc.errors import ConfigError
from extproc.gateway import envoyconf
from extproc.gateway.server import Service
from extproc.gateway.tls import ServerCertificates
from extproc_dev.stack import LocalStack, envoy_binary
from tests.conftest import pool
from tests.extproc_client import Stream, admit_one
from tests.redis_server import Certs

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def issue(ca: Certs, name: str, cn: str, *, server: bool = False) -> Pair:
    """A certificate signed by ``ca`` (a fresh key, a fresh serial), made with openssl."""
    directory = ca.ca.parent

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
        *(["-extfile", "san.ext"] if server else []))
    return Pair(directory / f"{name}.crt", directory / f"{name}.key")


@dataclass(frozen=True)
class Pki:
    ca: Certs  # our CA, with the server certificate for 127.0.0.1 / localhost
    client: Pair  # Envoy's client certificate, signed by our CA
    stranger: Pair  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = Certs.make(tmp_path_factory.mktemp("ca"))
    other = Certs.make(tmp_path_factory.mktemp("other-ca"))
    return Pki(ca, issue(ca, "envoy", "envoy"), issue(other, "stranger", "envoy"))


def served_files(pki: Pki, directory: Path) -> dict[str, str]:
    """A copy of the server's files the test may replace, as the ``tls`` section."""
    directory.mkdir(parents=True, exist_ok=True)
    for src in (pki.ca.cert, pki.ca.key):
        shutil.copy(src, directory / src.name)
    return {"cert_file": str(directory / pki.ca.cert.name),
            "key_file": str(directory / pki.ca.key.name),
            "client_ca_file": str(pki.ca.ca)}


def settings(**extra: Any) -> dict[str, Any]:
    return {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
            "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}], **extra}


@pytest.fixture
async def tls_service(pki: Pki, tmp_path: Path) -> AsyncIterator[Service]:
    svc = Service(config.from_mapping(settings(
        tls={**served_files(pki, tmp_path / "served"), "reload_interval_s": 0})))
    await svc.start()
    yield svc
    await Stream.end_all()
    await svc.stop()


def credentials(pki: Pki, client: Pair | None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(pki.ca.ca.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.ca.read_bytes(), client.key.read_bytes(),
                                        client.cert.read_bytes())


async def health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def served_certificate(port: int, pki: Pki) -> dict[str, Any]:
    """The certificate the server presents to a new connection, read by an OpenSSL client
    that verifies it against our CA and presents Envoy's client certificate."""
    ctx = ssl.create_default_context(cafile=str(pki.ca.ca))
    ctx.load_cert_chain(str(pki.client.cert), str(pki.client.key))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as conn:
        cert = conn.getpeercert()
    assert cert is not None
    return cert


def common_name(cert: dict[str, Any]) -> str:
    return next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName")


# --- mutual TLS on the listener --------------------------------------------------------------

async def test_a_client_with_our_certificate_gets_answers(tls_service: Service,
                                                          pki: Pki) -> None:
    target = f"127.0.0.1:{tls_service.grpc_port}"
    async with grpc.aio.secure_channel(target, credentials(pki, pki.client)) as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        stream = await admit_one(pb_grpc.ExternalProcessorStub(channel))
        assert (await tls_service.gate.ledger.snapshot("llama")).inflight == 1
        await stream.close()


@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate", "plaintext"])
async def test_a_client_without_our_certificate_fails_the_handshake(
        tls_service: Service, pki: Pki, client: str) -> None:
    target = f"127.0.0.1:{tls_service.grpc_port}"
    channel = (grpc.aio.insecure_channel(target) if client == "plaintext" else
               grpc.aio.secure_channel(target, credentials(
                   pki, None if client == "no certificate" else pki.stranger)))
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health(channel)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_replaced_certificate_files_are_served_to_new_connections_without_restart(
        tls_service: Service, pki: Pki) -> None:
    assert tls_service.config.tls is not None
    port, served = tls_service.grpc_port, tls_service.config.tls
    before = await asyncio.to_thread(served_certificate, port, pki)
    assert common_name(before) == "localhost"
    target = f"127.0.0.1:{port}"
    old_channel = grpc.aio.secure_channel(target, credentials(pki, pki.client))
    assert await health(old_channel) == health_pb2.HealthCheckResponse.SERVING

    rotated = issue(pki.ca, "rotated", "localhost-rotated", server=True)
    os.replace(rotated.key, served.key_file)  # renames, as a Secret update swaps files
    os.replace(rotated.cert, served.cert_file)
    after = await asyncio.to_thread(served_certificate, port, pki)
    assert common_name(after) == "localhost-rotated"
    assert after["serialNumber"] != before["serialNumber"]
    async with grpc.aio.secure_channel(target, credentials(pki, pki.client)) as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await health(old_channel) == health_pb2.HealthCheckResponse.SERVING  # kept
    await old_channel.close()

    # a key that does not belong to the certificate is refused: the last good set stays
    shutil.copy(pki.stranger.key, served.key_file)
    again = await asyncio.to_thread(served_certificate, port, pki)
    assert again["serialNumber"] == after["serialNumber"]
    reloads = tls_service.metrics.registry.get_sample_value
    assert reloads("extproc_tls_reloads_total", {"result": "ok"}) == 1
    assert reloads("extproc_tls_reloads_total", {"result": "refused"}) == 1


def test_files_are_checked_at_most_every_reload_interval(pki: Pki, tmp_path: Path) -> None:
    files = served_files(pki, tmp_path)
    now = [100.0]
    certs = ServerCertificates(ServerTls(**files, reload_interval_s=30.0),
                               clock=lambda: now[0])
    rotated = issue(pki.ca, "interval", "localhost-interval", server=True)
    os.replace(rotated.key, files["key_file"])
    os.replace(rotated.cert, files["cert_file"])
    now[0] += 29.0
    assert certs.fetch() is None  # not looked at yet
    now[0] += 1.0
    assert certs.fetch() is not None  # changed: a new configuration
    now[0] += 30.0
    assert certs.fetch() is None  # unchanged since


def test_tls_settings_are_checked_at_start_naming_the_key(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"tls": {"cert_file": str(tmp_path / "missing.crt"),
                                     "reload_interval_s": -1}})
    text = "\n".join(err.value.problems)
    assert "tls.key_file: required" in text
    assert "tls.client_ca_file: required (clients must present a certificate)" in text
    assert "tls.cert_file: no such file" in text
    assert "tls.reload_interval_s: must be >= 0" in text
    mismatched = {"cert_file": str(pki.ca.cert), "key_file": str(pki.client.key),
                  "client_ca_file": str(pki.ca.key)}
    with pytest.raises(ConfigError) as err:
        Service(config.from_mapping(settings(tls=mismatched)))
    text = "\n".join(err.value.problems)
    assert "tls.key_file: not the unencrypted private key of tls.cert_file" in text
    assert "tls.client_ca_file:" in text


# --- Envoy's side ----------------------------------------------------------------------------

def extproc_cluster(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc")


def test_envoy_gets_a_client_certificate_and_a_pipe_address(pki: Pki, tmp_path: Path) -> None:
    c = config.from_mapping({})
    topo = envoyconf.Topology(
        extproc=envoyconf.extproc_endpoint("unix:/run/extproc/extproc.sock"),
        extproc_tls=envoyconf.ExtprocTls(str(pki.client.cert), str(pki.client.key),
                                         str(pki.ca.ca), server_name="localhost"))
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(c, topo))
    cluster = extproc_cluster(yaml.safe_load(path.read_text()))
    [endpoint] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": "/run/extproc/extproc.sock"}}
    socket_ = cluster["transport_socket"]
    assert socket_["name"] == "envoy.transport_sockets.tls"
    context = socket_["typed_config"]
    assert context["sni"] == "localhost"
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["tls_certificates"] == [{
        "certificate_chain": {"filename": str(pki.client.cert)},
        "private_key": {"filename": str(pki.client.key)}}]
    assert common["validation_context"]["trusted_ca"] == {"filename": str(pki.ca.ca)}
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "localhost"}}]
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    plain = extproc_cluster(envoyconf.bootstrap(c, envoyconf.Topology()))
    assert "transport_socket" not in plain


def post_chat(stack: LocalStack) -> int:
    req = urllib.request.Request(
        stack.url + CHAT, method="POST", headers={"content-type": "application/json"},
        data=b'{"model": "m", "max_tokens": 5, "extproc_output_tokens": 2,'
             b' "messages": [{"role": "user", "content": "hi"}]}')
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


def envoy_stat(stack: LocalStack, name: str) -> int:
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=^{name}$"
    with urllib.request.urlopen(url, timeout=5) as resp:
        line = resp.read().decode().strip()
    return int(line.rpartition(": ")[2]) if line else 0


def admitted(stack: LocalStack) -> float:
    return stack.metric("extproc_admission_decisions_total", {"outcome": "admit"})


@pytest.mark.integration
def test_envoy_reaches_the_processor_over_mutual_tls(stack_factory: Any, pki: Pki,
                                                     tmp_path: Path) -> None:
    """Fail-closed, so a 200 needs the processor's answer, which needs the handshake."""
    stack = stack_factory(
        {"pools": [pool()], "tls": served_files(pki, tmp_path / "served")}, fail_open=False,
        envoy={"extproc_tls": envoyconf.ExtprocTls(
            str(pki.client.cert), str(pki.client.key), str(pki.ca.ca), server_name="localhost")})
    assert post_chat(stack) == 200
    assert admitted(stack) == 1
    assert envoy_stat(stack, "cluster.extproc.ssl.handshake") >= 1
    assert envoy_stat(stack, "cluster.extproc.ssl.connection_error") == 0


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory: a socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="xp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.integration
def test_envoy_reaches_the_processor_over_a_unix_socket(stack_factory: Any,
                                                        socket_dir: Path) -> None:
    sock = socket_dir / "extproc.sock"
    stack = stack_factory({"pools": [pool()]}, fail_open=False, extproc_listen=f"unix:{sock}")
    assert sock.is_socket()
    assert post_chat(stack) == 200
    assert admitted(stack) == 1
    with socket.socket(socket.AF_INET) as probe:  # nothing listens on the TCP port it got
        assert probe.connect_ex(("127.0.0.1", stack.grpc_port)) != 0
