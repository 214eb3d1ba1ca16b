"""Tenant trust: the tenant comes only from what Envoy vouches for, never from what a client
claims. Resolution and configuration first, then the server over real gRPC, then real Envoy
verifying real (HS256) JWTs in front of ``extproc serve``, attacked with spoofed headers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import http.client
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
from envoy_data_plane.envoy.config.core.v3 import (
    DataSource,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
)
from envoy_data_plane.envoy.config.route.v3 import RouteMatch
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
    HeaderMutation as HeaderMutationFilter,
)
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
    Mutations as HeaderMutationFilterMutations,
)
from envoy_data_plane.envoy.extensions.filters.http.jwt_authn.v3 import (
    JwtAuthentication,
    JwtClaimToHeader,
    JwtProvider,
    JwtRequirement,
    JwtRequirementOrList,
    RequirementRule,
)
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpFilter,
)
from envoy_data_plane.google.protobuf import Any as AnyProto
from envoy_data_plane.google.protobuf import Empty
from google.protobuf import struct_pb2

from extproc import config
from extproc.errors import ConfigError
from extproc.gateway import envoyconf
from extproc.gateway.server import Service
from extproc.gateway.tenant import Fallback, Tenants
from extproc.observability import decisionlog
from extproc_dev.stack import LocalStack
from tests.conftest import pool
from tests.extproc_client import Stream, body, chat, headers
from tests.traffic import Ask as TrafficAsk
from tests.traffic import Traffic, count, figures

CHAT = "/v1/chat/completions"
ISSUER = "https://issuer.extproc.test"
KEY = b"extproc-test-hs256-key-0123456789abcdef"  # an HS256 secret: 32+ bytes
KNOWN = ["acme", "globex"]


def tenants(**section: Any) -> Tenants:
    return Tenants(config.from_mapping({"tenant": section}).tenant)


def jwt_metadata(payload: dict[str, Any], namespace: str = "envoy.filters.http.jwt_authn",
                 key: str = "jwt_payload") -> dict[str, struct_pb2.Struct]:
    """``filter_metadata`` as jwt_authn's ``payload_in_metadata`` fills it."""
    struct = struct_pb2.Struct()
    struct.update({key: payload} if key else payload)
    return {namespace: struct}


# --- resolution ------------------------------------------------------------------------------

def test_metadata_source_reads_the_claim_of_the_verified_payload() -> None:
    t = tenants(source="metadata", known=KNOWN)
    got = t.resolve(jwt_metadata({"tenant": "acme", "sub": "u1"}), [("x-tenant-id", "globex")])
    assert got is not None and (got.name, got.label, got.fallback) == ("acme", "acme", None)


def test_a_tenant_not_in_known_is_named_but_labelled_other() -> None:
    got = tenants(source="metadata", known=KNOWN).resolve(jwt_metadata({"tenant": "initech"}), [])
    assert got is not None and (got.name, got.label) == ("initech", "other")


def test_no_payload_no_claim_or_a_malformed_claim_is_the_default_tenant() -> None:
    t = tenants(source="metadata", known=KNOWN, default="anon")
    cases = {
        "no metadata": ({}, Fallback.MISSING),
        "no claim": (jwt_metadata({"sub": "u1"}), Fallback.MISSING),
        "a list": (jwt_metadata({"tenant": ["acme", "globex"]}), Fallback.INVALID),
        "a boolean": (jwt_metadata({"tenant": True}), Fallback.INVALID),
        "a fraction": (jwt_metadata({"tenant": 1.5}), Fallback.INVALID),
        "empty": (jwt_metadata({"tenant": "  "}), Fallback.INVALID),
        "too long": (jwt_metadata({"tenant": "a" * 300}), Fallback.INVALID),
    }
    for case, (metadata, why) in cases.items():
        got = t.resolve(metadata, [])
        assert got is not None, case
        assert (got.name, got.label, got.fallback) == ("anon", "anon", why), case


def test_a_whole_number_claim_and_a_nested_claim_path() -> None:
    numeric = tenants(source="metadata").resolve(jwt_metadata({"tenant": 42}), [])
    assert numeric is not None and numeric.name == "42"
    nested = tenants(source="metadata", metadata_namespace="tenancy", metadata_key="",
                     claim=["org", "id"])
    got = nested.resolve(jwt_metadata({"org": {"id": "acme"}}, "tenancy", ""), [])
    assert got is not None and got.name == "acme"


def test_looking_up_a_missing_claim_does_not_create_it() -> None:
    metadata = jwt_metadata({"sub": "u1"})
    tenants(source="metadata", claim=["tenant", "id"]).resolve(metadata, [])
    assert "tenant" not in metadata["envoy.filters.http.jwt_authn"]["jwt_payload"]


def test_header_source_takes_exactly_one_copy_of_its_own_header() -> None:
    t = tenants(source="header", known=KNOWN)
    one = t.resolve(jwt_metadata({"tenant": "globex"}), [("x-tenant-id", " acme ")])
    assert one is not None and one.name == "acme"  # metadata is not this source
    for spoof in ([("x-tenant-id", "acme"), ("x-tenant-id", "globex")],  # sent twice
                  [("x-tenant-id", "acme,globex")]):  # or joined
        got = t.resolve({}, spoof)
        assert got is not None and (got.name, got.fallback) == ("anonymous", Fallback.AMBIGUOUS)
    other = t.resolve({}, [("x_tenant_id", "globex"), ("x-tenant-idx", "globex")])
    assert other is not None and (other.name, other.fallback) == ("anonymous", Fallback.MISSING)


def test_source_none_attributes_nothing() -> None:
    assert tenants().resolve(jwt_metadata({"tenant": "acme"}), [("x-tenant-id", "a")]) is None


# --- configuration ---------------------------------------------------------------------------

def test_defaults_are_off_with_jwt_authn_names() -> None:
    t = config.from_mapping({}).tenant
    assert t.source is config.TenantSource.NONE
    assert (t.metadata_namespace, t.metadata_key, t.claim, t.header, t.default) == (
        "envoy.filters.http.jwt_authn", "jwt_payload", ("tenant",), "x-tenant-id", "anonymous")


def test_every_tenant_problem_is_reported_naming_its_key() -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"tenant": {
            "source": "header", "header": "X_Tenant", "claim": "tenant",
            "known": ["acme", "acme", "other", ""], "default": "x" * 65, "colour": 1}})
    text = "\n".join(err.value.problems)
    assert "tenant.claim: only used with tenant.source 'metadata' (source is 'header')" in text
    assert "tenant.header: must be a lower-case header name" in text
    assert "tenant.known: duplicate name 'acme'" in text
    assert "tenant.known[2]: is reserved for tenants not in tenant.known" in text
    assert "tenant.known[3]: must be 1 to 64 characters" in text
    assert "tenant.default: must be 1 to 64 characters" in text
    assert "tenant.colour: unknown key" in text
    with pytest.raises(ConfigError, match=r"tenant.source: must be one of 'none', 'metadata'"):
        config.from_mapping({"tenant": {"source": "jwt"}})
    with pytest.raises(ConfigError, match=r"tenant.known: at most 100 names"):
        config.from_mapping({"tenant": {"source": "metadata",
                                        "known": [f"t{i}" for i in range(101)]}})
    with pytest.raises(ConfigError, match=r"tenant.claim: must be a claim name"):
        config.from_mapping({"tenant": {"source": "metadata", "claim": []}})


# --- Envoy configuration ---------------------------------------------------------------------

def _hcm_and_ext_proc(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    return hcm, ext["typed_config"]


def test_metadata_source_forwards_only_its_namespace_and_drops_underscore_headers() -> None:
    c = config.from_mapping({"tenant": {"source": "metadata", "metadata_namespace": "ns.x"}})
    hcm, ext = _hcm_and_ext_proc(envoyconf.bootstrap(c, envoyconf.Topology()))
    # forwarded: the tenant's namespace alone; received back: only the verdict's (access log)
    assert ext["metadata_options"] == {"forwarding_namespaces": {"untyped": ["ns.x"]},
                                       "receiving_namespaces": {"untyped": ["extproc"]}}
    assert hcm["common_http_protocol_options"] == {
        "headers_with_underscores_action": "DROP_HEADER"}
    assert "early_header_mutation_extensions" not in hcm


def test_header_source_removes_every_client_copy_before_any_filter() -> None:
    c = config.from_mapping({"tenant": {"source": "header", "header": "x-org"}})
    hcm, ext = _hcm_and_ext_proc(envoyconf.bootstrap(c, envoyconf.Topology()))
    assert "forwarding_namespaces" not in ext["metadata_options"]
    [early] = hcm["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [{"remove": "x-org"}]
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "DROP_HEADER"


def test_the_priority_header_is_removed_from_clients_like_the_tenant_header() -> None:
    c = config.from_mapping({"tenant": {"source": "header", "header": "x-org"},
                             "priority": {"header": "x-priority"}})
    hcm, _ = _hcm_and_ext_proc(envoyconf.bootstrap(c, envoyconf.Topology()))
    [early] = hcm["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [{"remove": "x-org"}, {"remove": "x-priority"}]
    alone = config.from_mapping({"priority": {"header": "x-priority"}})
    hcm, _ = _hcm_and_ext_proc(envoyconf.bootstrap(alone, envoyconf.Topology()))
    [early] = hcm["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [{"remove": "x-priority"}]


def test_without_tenant_attribution_none_of_it_is_rendered() -> None:
    hcm, ext = _hcm_and_ext_proc(envoyconf.bootstrap(config.from_mapping({}),
                                                     envoyconf.Topology()))
    assert "forwarding_namespaces" not in ext["metadata_options"]
    assert "common_http_protocol_options" not in hcm


def jwks() -> str:
    return json.dumps({"keys": [{"kty": "oct", "kid": "k1", "alg": "HS256",
                                 "k": _b64(KEY)}]})


def jwt_filter(claim_to_header: bool = False) -> HttpFilter:
    """jwt_authn verifying our HS256 tokens from a local JWKS; a request without a token
    passes (the default tenant), one with a bad token is refused (401)."""
    provider = JwtProvider(
        issuer=ISSUER, local_jwks=DataSource(inline_string=jwks()),
        payload_in_metadata="jwt_payload",
        claim_to_headers=([JwtClaimToHeader(header_name="x-tenant-id", claim_name="tenant")]
                          if claim_to_header else []))
    return HttpFilter(name="envoy.filters.http.jwt_authn", typed_config=AnyProto.pack(
        JwtAuthentication(providers={"test": provider}, rules=[RequirementRule(
            match=RouteMatch(prefix="/"),
            requires=JwtRequirement(requires_any=JwtRequirementOrList(requirements=[
                JwtRequirement(provider_name="test"), JwtRequirement(allow_missing=Empty()),
            ])),
        )])))


def test_the_operators_filters_come_before_ext_proc() -> None:
    """(Real Envoy loads these bootstraps in the end-to-end test below.)"""
    c = config.from_mapping({"tenant": {"source": "metadata"}})
    hcm, _ = _hcm_and_ext_proc(envoyconf.bootstrap(c, envoyconf.Topology(
        http_filters=(jwt_filter(),))))
    held = [envoyconf.BUFFER_FILTER] if envoyconf.Topology().one_trip else []  # one trip
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.jwt_authn", "envoy.filters.http.ext_proc", *held,
        "envoy.filters.http.router"]
    jwt = hcm["http_filters"][0]["typed_config"]
    assert jwt["providers"]["test"]["payload_in_metadata"] == "jwt_payload"


# --- the server, over real gRPC --------------------------------------------------------------

@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    svc = Service(config.from_mapping({
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
        "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}],
        "decision_log": str(tmp_path / "decisions.jsonl"),
        "max_body_bytes": 1024,
        "tenant": {"source": "metadata", "known": KNOWN}}))
    await svc.start()
    yield svc
    await Stream.end_all()
    await svc.stop()


def with_metadata(message: pb.ProcessingRequest, payload: dict[str, Any]) -> pb.ProcessingRequest:
    for namespace, struct in jwt_metadata(payload).items():
        message.metadata_context.filter_metadata[namespace].CopyFrom(struct)
    return message


def tenant_count(service: Service, tenant: str, outcome: str | None = None) -> float:
    return sum(s.value for m in service.metrics.tenant_decisions.collect() for s in m.samples
               if s.labels["tenant"] == tenant and outcome in (None, s.labels["outcome"]))


async def test_the_server_charges_the_tenant_of_the_forwarded_metadata(
        service: Service, tmp_path: Path) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for payload, extra in (({"tenant": "acme"}, {"x-tenant-id": "globex"}),
                               ({"tenant": "initech"}, {}), ({}, {"x-tenant-id": "globex"})):
            s = Stream(stub)
            await s.send(with_metadata(headers(**extra), payload))
            assert (await s.send(body(chat()))).HasField("request_body")
            await s.close()
        s = Stream(stub)  # refused before any decision (413): attributed all the same
        answer = await s.send(with_metadata(headers(**{"content-length": "4096"}),
                                            {"tenant": "acme"}))
        assert answer.immediate_response.status.code == 413
    assert tenant_count(service, "acme", "admit") == 1
    assert tenant_count(service, "acme", "invalid") == 1
    assert tenant_count(service, "other") == 1 and tenant_count(service, "anonymous") == 1
    assert tenant_count(service, "globex") == 0
    assert service.metrics.registry.get_sample_value(
        "extproc_tenant_fallbacks_total", {"why": "missing"}) == 1
    service.gate.decision_log.flush()  # type: ignore[union-attr]
    records = list(decisionlog.read(tmp_path / "decisions.jsonl"))
    logged = sorted(r.tenant or "" for r in records)
    assert logged == ["acme", "anonymous", "initech"]
    assert {r.priority for r in records} == {0}  # standard: nothing names another


# --- end to end: real Envoy verifying real JWTs ----------------------------------------------

def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def token(tenant: str | None, key: bytes = KEY) -> str:
    """An HS256 JWT, signed here with hmac (RFC 7519)."""
    claims: dict[str, Any] = {"iss": ISSUER, "sub": "user-1", "exp": int(time.time()) + 3600}
    if tenant is not None:
        claims["tenant"] = tenant
    signing_input = ".".join(_b64(json.dumps(part, separators=(",", ":")).encode()) for part in
                             ({"alg": "HS256", "typ": "JWT", "kid": "k1"}, claims))
    signature = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def send(stack: LocalStack, extra: list[tuple[str, str]]) -> int:
    """POST a chat request with exactly these extra headers (repeats and case kept)."""
    raw = json.dumps({"model": "m", "max_tokens": 5, "extproc_output_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=30)
    try:
        conn.putrequest("POST", CHAT, skip_accept_encoding=True)
        for name, value in [("content-type", "application/json"),
                            ("content-length", str(len(raw))), *extra]:
            conn.putheader(name, value)
        conn.endheaders(raw)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def header_setter() -> HttpFilter:
    """Sets x-tenant-id from the verified payload jwt_authn left in the metadata, adding to any
    copy already there: unlike claim_to_headers (which clears its own headers first) it
    relies on Envoy's early removal of the client's copies, which is what this proves."""
    return HttpFilter(name="envoy.filters.http.header_mutation", typed_config=AnyProto.pack(
        HeaderMutationFilter(mutations=HeaderMutationFilterMutations(request_mutations=[
            HeaderMutation(append=HeaderValueOption(
                header=HeaderValue(key="x-tenant-id", value=(
                    "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:jwt_payload:tenant)%")),
                append_action=HeaderValueOptionHeaderAppendAction.APPEND_IF_EXISTS_OR_ADD)),
        ]))))


SETUPS: dict[str, tuple[str, tuple[HttpFilter, ...]]] = {
    # tenant.source, the filters before ext_proc
    "metadata": ("metadata", (jwt_filter(),)),
    "claim_to_headers": ("header", (jwt_filter(claim_to_header=True),)),
    "header_mutation": ("header", (jwt_filter(), header_setter())),
}


def envoy_stat(stack: LocalStack, name: str) -> int:
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=^{name}$"
    with urllib.request.urlopen(url, timeout=5) as resp:
        line = resp.read().decode().strip()
    return int(line.rpartition(": ")[2]) if line else 0


@pytest.mark.integration
@pytest.mark.parametrize("setup", list(SETUPS))
def test_spoofed_tenant_headers_never_charge_another_tenant(
        stack_factory: Any, tmp_path: Path, setup: str) -> None:
    """Envoy verifies the JWT; the tenant reaches us in its dynamic metadata, or in the
    x-tenant-id header set by jwt_authn's claim_to_headers or by header_mutation."""
    source, filters = SETUPS[setup]
    log_path = tmp_path / f"decisions-{setup}.jsonl"
    stack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=8)], "decision_log": str(log_path),
         "tenant": {"source": source, "known": KNOWN}},
        fail_open=False, envoy={"http_filters": filters})
    bearer = ("authorization", f"Bearer {token('acme')}")
    attempts = {
        "valid token": [bearer],
        "spoofed header": [bearer, ("x-tenant-id", "globex")],
        "spoofed, other case": [bearer, ("X-Tenant-Id", "globex")],
        "spoofed twice": [bearer, ("x-tenant-id", "globex"), ("X-TENANT-ID", "initech")],
        "spoofed with underscores": [bearer, ("x_tenant_id", "globex")],
    }
    for what, extra in attempts.items():
        assert send(stack, extra) == 200, what
    # no token (allowed: the default tenant), whatever the headers say
    assert send(stack, [("x-tenant-id", "globex"), ("x_tenant_id", "globex")]) == 200
    assert send(stack, [("authorization", f"Bearer {token('initech')}")]) == 200
    # a token Envoy cannot verify never reaches us: 401 from jwt_authn
    assert send(stack, [("authorization", f"Bearer {token('globex', b'wrong' * 8)}"),
                        ("x-tenant-id", "globex")]) == 401

    def count(tenant: str) -> float:
        return stack.metric("extproc_tenant_decisions_total", {"tenant": tenant})

    wait_for(lambda: count("acme") == len(attempts))
    assert count("anonymous") == 1 and count("other") == 1 and count("globex") == 0
    assert stack.metric("extproc_tenant_fallbacks_total", {"why": "ambiguous"}) == 0
    assert envoy_stat(stack, "http1.dropped_headers_with_underscores") == 2
    stack.stop()  # flushes the decision log
    logged = sorted(r.tenant or "" for r in decisionlog.read(log_path))
    assert logged == ["acme"] * len(attempts) + ["anonymous", "initech"]


# --- fair shares, end to end -------------------------------------------------------------------

async def neighbours(stack: LocalStack, seconds: float = 6.0) -> tuple[float, float]:
    """Tenant acme sends 10 requests a second, steadily; tenant globex floods the gateway
    with 32 clients that send again the moment they are answered (429s included). Returns
    the share of each tenant's requests served (200)."""
    steady = Traffic(stack.url, TrafficAsk(max_tokens=16, output_tokens=8,
                                           bearer=token("acme")), timeout_s=30.0)
    flood = Traffic(stack.url, TrafficAsk(max_tokens=16, output_tokens=8,
                                          bearer=token("globex")), timeout_s=30.0)
    async with steady, flood:
        stop = asyncio.Event()
        burst = asyncio.create_task(flood.closed(32, stop))
        await asyncio.sleep(1.0)  # the flood is on before acme's measured requests
        await steady.open(10.0, seconds)
        stop.set()
        await burst

    def served(t: Traffic) -> float:
        return count(t.replies).get("200", 0) / max(1, len(t.replies))

    return served(steady), served(flood)


@pytest.mark.integration
def test_a_flooding_tenant_does_not_take_a_steady_tenant_s_share(stack_factory: Any) -> None:
    """Real Envoy verifying real JWTs, a fake backend of 8 slots: with fair shares on, the
    steady tenant is served (the flooding one absorbs the 429s); with them off, the flood
    takes the slots as they free and the steady tenant is refused with it."""
    results = {}
    for fair in (True, False):
        stack = stack_factory(
            {"pools": [pool(max_num_seqs=8)],
             "tenant": {"source": "metadata", "known": KNOWN, "fair_share": fair}},
            envoy={"http_filters": (jwt_filter(),)},
            backend_args=["--max-running", "8", "--time-scale", "0.5"])
        results[fair] = asyncio.run(neighbours(stack))
        refusals = stack.metric("extproc_priority_decisions_total", {"reason": "fair_share"})
        assert (refusals > 0) is fair
        stack.stop()
    (acme_fair, globex_fair), (acme_plain, _) = results[True], results[False]
    print(figures(acme_fair=acme_fair, globex_fair=globex_fair, acme_plain=acme_plain))
    # 0.98 on a quiet machine; 0.87 in a clean-clone CI run beside two CPU-burning processes
    # (globex 0.10, acme without fair shares 0.07)
    assert acme_fair >= 0.8
    assert acme_fair > globex_fair
    assert acme_fair > acme_plain + 0.1


def priority_setter(value: str) -> HttpFilter:
    """An operator's filter naming the priority (here for every request; per route or from a
    verified claim in practice)."""
    return HttpFilter(name="envoy.filters.http.header_mutation", typed_config=AnyProto.pack(
        HeaderMutationFilter(mutations=HeaderMutationFilterMutations(request_mutations=[
            HeaderMutation(append=HeaderValueOption(
                header=HeaderValue(key="x-priority", value=value),
                append_action=HeaderValueOptionHeaderAppendAction.APPEND_IF_EXISTS_OR_ADD)),
        ]))))


@pytest.mark.integration
def test_a_client_cannot_state_its_own_priority(stack_factory: Any) -> None:
    """Through real Envoy: a client's x-priority never arrives (removed before any filter);
    the one the operator's filter sets does."""
    settings = {"pools": [pool(max_num_seqs=8)], "priority": {"header": "x-priority"}}
    plain = stack_factory(settings)
    assert send(plain, [("x-priority", "critical")]) == 200
    assert send(plain, [("X-Priority", "critical"), ("x-priority", "100")]) == 200

    def decided(stack: LocalStack, priority: str) -> float:
        return stack.metric("extproc_priority_decisions_total", {"priority": priority})

    wait_for(lambda: decided(plain, "standard") == 2)
    assert decided(plain, "critical") == 0 and decided(plain, "100") == 0
    set_by_envoy = stack_factory(settings, envoy={"http_filters": (priority_setter("sheddable"),)})
    assert send(set_by_envoy, [("x-priority", "critical")]) == 200
    wait_for(lambda: decided(set_by_envoy, "sheddable") == 1)
    assert decided(set_by_envoy, "critical") == 0
