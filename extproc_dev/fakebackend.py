"""A fake OpenAI-compatible inference server whose timing is the project's engine model.

It stands in for vLLM in tests, the demo and benchmarks. Each replica is one ``Engine``: the
scheduler of ``extproc.fleet.engine`` (vLLM V1's rules: a token budget per step, chunked prefill, KV
blocks allocated as sequences grow, preemption by recomputation) run in real time: a step
sleeps its ``step_ms`` times ``time_scale`` to an absolute deadline (timer granularity, ~1 ms,
does not add up at a small ``time_scale``), then every sequence that completed its prompt gets
its next token. The simulator runs the same scheduler in virtual time, so what a test sees
here is what the simulator predicts.

A request whose prompt and output could never fit (``max_model_len``, or the whole KV cache)
gets a 400, as vLLM answers. A request whose client goes away leaves the waiting queue at once
and the batch at the next step, freeing its blocks as vLLM's abort does; serve the app with
``handler_cancellation=True`` (``serve`` and aiohttp's ``TestServer`` do) so a disconnect is
seen before anything is written. With ``replicas > 1`` a request joins the replica with the
fewest running + waiting. ``/metrics`` uses vLLM's names summed over replicas (with
``vllm:cache_config_info`` carrying ``block_size`` and ``num_gpu_blocks`` as labels, as vLLM
does); the end-to-end, queue and output-length (``vllm:request_generation_tokens``)
histograms count completed requests only, and the first-token and inter-token ones
(``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``) each token as it
is generated, a request later abandoned included, as vLLM's do.

Output lengths follow vLLM's length controls: ``ignore_eos: true`` gives exactly ``max_tokens``
(``max_completion_tokens`` for chat), as load tools that want fixed output lengths expect;
``min_tokens`` is a floor under the model's own length (the drawn one, or the
``extproc_output_tokens`` extension). Without an explicit limit the cap is
``DEFAULT_MAX_TOKENS`` (raised to ``min_tokens``; ``ignore_eos`` alone gives that many), where
vLLM's is the rest of the context.

``serve``'s access log is aiohttp's, except that ``/health`` and ``/metrics`` probes go to DEBUG: a
load test's scrapes and health checks would otherwise be most of the lines.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import random
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import generate_latest

from extproc.errors import BadRequest
from extproc.fleet.engine import EngineModel, Scheduler, Sequence

TOKEN_TEXT = " tok"
DEFAULT_MAX_TOKENS = 256
EMBEDDING_DIM = 8  # small on purpose: the vectors mean nothing, their cost is the prompt's
LENGTH_MU, LENGTH_SIGMA = 5.02, 0.86  # log-normal output lengths, Azure conversation trace fit
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# vLLM's 1-2-5 series up to the model's context length (here 20,000 tokens)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
PROBE_PATHS = frozenset({"/health", "/metrics"})  # access-logged at DEBUG, not INFO


class Request(Sequence):
    """One request inside an engine; times are ``loop.time()`` seconds."""

    __slots__ = ("admitted", "arrived", "finished", "first_token", "last_token", "tokens")

    def __init__(self, prompt_tokens: int, output_tokens: int, arrived: float) -> None:
        super().__init__(prompt_tokens, output_tokens)
        self.arrived = arrived
        self.admitted = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.finished = 0.0
        self.tokens: asyncio.Queue[int] = asyncio.Queue()  # index of each new token


class Engine:
    """One replica: ``extproc.fleet.engine.Scheduler`` stepped in real time."""

    def __init__(self, model: EngineModel, time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.model = model
        self.time_scale = time_scale
        self.sched = Scheduler(model)
        self.preemptions = 0
        self._wake = asyncio.Event()
        self.on_token: Callable[[Request, float], None] | None = None  # each token, as it comes

    @property
    def running(self) -> list[Sequence]:
        return self.sched.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.sched.waiting)

    @property
    def load(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting)

    def kv_used(self) -> int:
        """Tokens' worth of KV blocks in use."""
        return self.sched.kv_used_blocks * self.model.block_size

    def submit(self, seq: Request) -> None:
        """Queue ``seq``; BadRequest if it could never run (vLLM's 400)."""
        if not self.sched.fits_alone(seq):
            limit = min(self.model.max_model_len, self.model.kv_tokens or self.model.max_model_len)
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you"
                f" requested {seq.prompt_tokens + seq.output_tokens} tokens"
                f" ({seq.prompt_tokens} in the messages, {seq.output_tokens} in the"
                " completion).", code="context_length_exceeded")
        self.sched.add(seq)
        self._wake.set()

    def abort(self, seq: Request) -> None:
        """Drop ``seq`` wherever it is; a no-op once it has finished."""
        self.sched.remove(seq)

    async def run(self) -> None:
        """The scheduler loop; it waits on an event while there is no work."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            step = self.sched.schedule()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            now = loop.time()
            for seq in step.joined:
                if isinstance(seq, Request) and not seq.admitted:
                    seq.admitted = now
            self.preemptions += len(step.preempted)
            deadline = max(deadline, now - 1.0) + step.duration_ms * self.time_scale / 1000
            await asyncio.sleep(deadline - loop.time())
            before = [s.generated for s in step.seqs]
            finished = self.sched.complete(step)
            now = loop.time()
            for seq, gen in zip(step.seqs, before, strict=True):
                if seq.generated > gen and isinstance(seq, Request):
                    if self.on_token is not None:
                        self.on_token(seq, now)
                    if gen == 0:
                        seq.first_token = now
                    seq.last_token = now
                    seq.tokens.put_nowait(gen)
            for seq in finished:
                if isinstance(seq, Request):
                    seq.finished = now


def engine_flags(model: EngineModel) -> list[str]:
    """``fake-backend`` flags that give it ``model`` (the pool's engine, for the demo)."""
    flags: list[str] = []
    for f in dataclasses.fields(model):
        value = getattr(model, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "prefix_caching":
            flags.append(flag if value else "--no-prefix-caching")
        else:
            flags += [flag, str(value)]
    return flags


@dataclass(frozen=True)
class _Call:
    """What a completion request asks for."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    output_tokens: int | None  # the extproc_output_tokens extension; None: draw one
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool

    def length(self, natural: int) -> int:
        """The output length vLLM gives when the model would stop after ``natural`` tokens:
        ``max_tokens`` under ``ignore_eos`` (no EOS ends it early), else ``natural`` floored at
        ``min_tokens`` and capped at ``max_tokens`` (``_parse_call`` keeps min <= max)."""
        if self.ignore_eos:
            return self.max_tokens
        return max(1, self.min_tokens, min(natural, self.max_tokens))


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (type(value) is not int or value < 1):
        raise BadRequest(f"{key} must be a positive integer", param=key)
    return value


def _min_tokens(body: dict[str, Any], max_tokens: int | None) -> int:
    """``min_tokens`` (default 0), refused as vLLM's SamplingParams refuses it: negative, or
    above an explicit ``max_tokens``."""
    value = body.get("min_tokens", 0)
    if type(value) is not int:  # null too: vLLM's field is a plain int
        raise BadRequest("min_tokens must be an integer", param="min_tokens")
    if value < 0:
        raise BadRequest(f"min_tokens must be greater than or equal to 0, got {value}.",
                         param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens},"
                         f" got {value}.", param="min_tokens")
    return value


def _ignore_eos(body: dict[str, Any]) -> bool:
    """``ignore_eos`` (default false); anything but a JSON boolean is refused, null too."""
    value = body.get("ignore_eos", False)
    if not isinstance(value, bool):
        raise BadRequest("ignore_eos must be a boolean", param="ignore_eos")
    return value


def _token_ids(value: object) -> bool:
    """Whether ``value`` is a non-empty list of token ids (non-negative integers)."""
    return (isinstance(value, list) and bool(value)
            and all(type(t) is int and t >= 0 for t in value))


def _text_tokens(text: str) -> int:
    """A text's token count as this backend charges it: ``max(1, utf8_bytes // 4)``."""
    return max(1, len(text.encode()) // 4)


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """The prompt's token count: text at ``utf8_bytes // 4``, a token-id prompt
    (``"prompt": [128000, 9906, ...]``, as vLLM accepts) at its length."""
    if not chat:
        prompt = body.get("prompt")
        if _token_ids(prompt):
            return len(prompt)  # type: ignore[arg-type]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
        return _text_tokens(prompt)
    return _text_tokens(_prompt_text(body))


def _embedding_inputs(body: object) -> list[int]:
    """``input`` of an embeddings call -> the token count of each input: a string, a list of
    strings, a list of token ids or a list of such lists, as OpenAI's API and vLLM take it."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    value = body.get("input")
    if isinstance(value, str):
        return [_text_tokens(value)]
    if _token_ids(value):
        return [len(value)]  # type: ignore[arg-type]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [_text_tokens(v) for v in value]
        if all(_token_ids(v) for v in value):
            return [len(v) for v in value]
    raise BadRequest("input must be a string, a list of strings, a list of token ids or a"
                     " list of token-id lists", param="input")


def _prompt_text(body: dict[str, Any]) -> str:
    """A chat request's message text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    return "".join(map(str, parts))


def _parse_call(body: object, chat: bool) -> _Call:
    """Validate a request body; raises BadRequest naming the bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    limit = _positive_int(body, "max_completion_tokens") if chat else None
    limit = limit or _positive_int(body, "max_tokens")
    min_tokens = _min_tokens(body, limit)
    options = body.get("stream_options")
    return _Call(
        chat=chat,
        prompt_tokens=_prompt_tokens(body, chat),
        max_tokens=limit or max(DEFAULT_MAX_TOKENS, min_tokens),
        output_tokens=_positive_int(body, "extproc_output_tokens"),
        ignore_eos=_ignore_eos(body),
        min_tokens=min_tokens,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


async def _read_json(request: web.Request) -> object:
    try:
        return await request.json()
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BadRequest("the body is not valid JSON") from exc


def _error(exc: BadRequest) -> web.Response:
    error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    return web.json_response({"error": error}, status=exc.status)


def _choice(call: _Call, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    """One ``choices[0]`` entry: a full message, a stream delta, or completion text."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if call.chat and not call.stream:
        choice["message"] = {"role": "assistant", "content": text}
    elif call.chat:
        choice["delta"] = {"role": "assistant"} if first else {}
        if text:
            choice["delta"]["content"] = text
    else:
        choice["text"] = text
    return choice


def _sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class _Backend:
    """The app's state (engines, metrics, health) and its request handlers."""

    def __init__(self, model: EngineModel, replicas: int, model_name: str, seed: int,
                 time_scale: float) -> None:
        self.engines = [Engine(model, time_scale) for _ in range(replicas)]
        self.model_name, self.healthy, self.rng = model_name, True, random.Random(seed)
        self.registry = CollectorRegistry()
        self.kv_capacity = model.kv_tokens * replicas
        labels, reg = ["model_name"], self.registry

        def gauge(name: str, doc: str, value: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=reg).labels(model_name).set_function(value)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        gauge("vllm:num_requests_running", "Sequences in the batch.",
              lambda: sum(len(e.running) for e in self.engines))
        gauge("vllm:num_requests_waiting", "Sequences queued.",
              lambda: sum(len(e.waiting) for e in self.engines))
        gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (0 when unlimited).",
              self.kv_usage)
        Gauge("vllm:cache_config_info", "Information of the KV cache configuration.",
              ["block_size", "num_gpu_blocks"], registry=reg).labels(
            str(model.block_size), str(model.num_gpu_blocks)).set(1)
        reg.register(_Preemptions(self))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Between two tokens.",
                             ITL_BUCKETS)
        for engine in self.engines:
            engine.on_token = self._token
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                             LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to admission.",
                               LATENCY_BUCKETS)
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Output tokens of each finished request.",
            TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Completed requests.",
                               [*labels, "finished_reason"], registry=reg)

    def _token(self, seq: Request, now: float) -> None:
        """A token of ``seq`` came at ``now``: its first (the first-token histogram) or the
        next (the inter-token one)."""
        if not seq.first_token:
            self.ttft.observe(now - seq.arrived)
        else:
            self.itl.observe(now - seq.last_token)

    def kv_usage(self) -> float:
        """``sum(kv_used) / (kv_cache_tokens * replicas)``; 0 when the cache is unlimited."""
        used = sum(e.kv_used() for e in self.engines)
        return used / self.kv_capacity if self.kv_capacity else 0.0

    async def run_engines(self, app: web.Application) -> AsyncIterator[None]:
        """``cleanup_ctx`` hook: one scheduler task per replica for the app's lifetime."""
        tasks = [asyncio.create_task(e.run()) for e in self.engines]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions and /v1/completions."""
        try:
            chat = request.path.endswith("/chat/completions")
            call = _parse_call(await _read_json(request), chat)
            wanted = call.output_tokens or round(self.rng.lognormvariate(LENGTH_MU, LENGTH_SIGMA))
            loop_time = asyncio.get_running_loop().time()
            seq = Request(call.prompt_tokens, call.length(wanted), loop_time)
            engine = min(self.engines, key=lambda e: e.load)
            engine.submit(seq)
        except BadRequest as exc:
            return _error(exc)
        reason = "length" if seq.output_tokens == call.max_tokens else "stop"
        try:
            if call.stream:
                response = await self._stream(request, call, seq, reason)
            else:
                response = await self._whole(call, seq, reason)
        finally:
            engine.abort(seq)  # frees the slot if the client went away
        self.queue.observe(seq.admitted - seq.arrived)
        self.e2e.observe(seq.finished - seq.arrived)
        self.generation_tokens.observe(seq.generated)
        self.success.labels(self.model_name, reason).inc()
        return response

    def _head(self, call: _Call) -> dict[str, Any]:
        kind = ("text_completion" if not call.chat
                else "chat.completion.chunk" if call.stream else "chat.completion")
        return {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name}

    @staticmethod
    def _usage(seq: Request) -> dict[str, int]:
        return {"prompt_tokens": seq.prompt_tokens, "completion_tokens": seq.output_tokens,
                "total_tokens": seq.prompt_tokens + seq.output_tokens}

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings: each input is a prefill-only request on an engine (one step
        past its prompt), answered with a small deterministic vector per input, as floats or
        as base64 of little-endian float32 (what the OpenAI SDK asks for by default)."""
        submitted: list[tuple[Engine, Request]] = []
        try:
            body = await _read_json(request)
            counts = _embedding_inputs(body)
            assert isinstance(body, dict)  # _embedding_inputs refuses anything else
            encoding = body.get("encoding_format", "float")
            if encoding not in ("float", "base64"):
                raise BadRequest("encoding_format must be float or base64",
                                 param="encoding_format")
            loop_time = asyncio.get_running_loop().time()
            for tokens in counts:
                seq = Request(tokens, 1, loop_time)
                engine = min(self.engines, key=lambda e: e.load)
                engine.submit(seq)
                submitted.append((engine, seq))
        except BadRequest as exc:
            for engine, seq in submitted:
                engine.abort(seq)
            return _error(exc)
        data = []
        try:
            for index, (_, seq) in enumerate(submitted):
                await seq.tokens.get()
                vector = [round(self.rng.uniform(-1, 1), 6) for _ in range(EMBEDDING_DIM)]
                packed: object = vector if encoding == "float" else base64.b64encode(
                    struct.pack(f"<{EMBEDDING_DIM}f", *vector)).decode()
                data.append({"object": "embedding", "index": index, "embedding": packed})
        finally:
            for engine, seq in submitted:
                engine.abort(seq)
        total = sum(counts)
        return web.json_response({"object": "list", "data": data, "model": self.model_name,
                                  "usage": {"prompt_tokens": total, "total_tokens": total}})

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one model this backend serves."""
        model = {"id": self.model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "extproc-fake-backend"}
        return web.json_response({"object": "list", "data": [model]})

    async def _whole(self, call: _Call, seq: Request, reason: str) -> web.StreamResponse:
        """The non-streaming answer, once the last token is out."""
        for _ in range(seq.output_tokens):
            await seq.tokens.get()
        choice = _choice(call, TOKEN_TEXT * seq.output_tokens, reason, first=True)
        answer = self._head(call) | {"choices": [choice], "usage": self._usage(seq)}
        return web.json_response(answer)

    async def _stream(self, request: web.Request, call: _Call, seq: Request,
                      reason: str) -> web.StreamResponse:
        """Server-Sent Events: a chunk per token, a finish_reason chunk, [usage], ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = self._head(call)
        for _ in range(seq.output_tokens):
            first = await seq.tokens.get() == 0
            await response.write(_sse(head | {"choices": [_choice(call, TOKEN_TEXT, None, first)]}))
        await response.write(_sse(head | {"choices": [_choice(call, "", reason, first=False)]}))
        if call.include_usage:
            await response.write(_sse(head | {"choices": [], "usage": self._usage(seq)}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while healthy, else 503."""
        return web.Response(status=200 if self.healthy else 503)

    async def set_health(self, request: web.Request) -> web.Response:
        """POST /admin/health ``{"healthy": bool}``."""
        try:
            body = await _read_json(request)
            if not isinstance(body, dict) or not isinstance(body.get("healthy"), bool):
                raise BadRequest('the body must be {"healthy": true|false}', param="healthy")
        except BadRequest as exc:
            return _error(exc)
        self.healthy = body["healthy"]
        return web.json_response({"healthy": self.healthy})

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Preemptions:
    """``vllm:num_preemptions_total``, summed over the replicas when scraped."""

    def __init__(self, backend: _Backend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("vllm:num_preemptions", "Preemptions (recomputation).",
                                     labels=["model_name"])
        family.add_metric([self.backend.model_name],
                          sum(e.preemptions for e in self.backend.engines))
        yield family


class _AccessLog(AccessLogger):
    """aiohttp's access log with ``PROBE_PATHS`` at DEBUG (method, path, status)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in PROBE_PATHS:
            super().log(request, response, time)
        elif self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("%s %s %s", request.method, request.path_qs, response.status)


def build_app(model: EngineModel, *, replicas: int = 1, model_name: str = "fake-llm",
              seed: int = 0, time_scale: float = 1.0) -> web.Application:
    """The fake server as an aiohttp app; its ``replicas`` engines share one port and registry.
    ``time_scale`` stretches every step (0.1: ten times faster than the model)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    backend = _Backend(model, replicas, model_name, seed, time_scale)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(backend.run_engines)
    app.add_routes([
        web.post("/v1/chat/completions", backend.completion),
        web.post("/v1/completions", backend.completion),
        web.post("/v1/embeddings", backend.embeddings),
        web.get("/v1/models", backend.models),
        web.get("/health", backend.health),
        web.post("/admin/health", backend.set_health),
        web.get("/metrics", backend.metrics),
    ])
    return app


async def serve(host: str, port: int, model: EngineModel, *, replicas: int = 1,
                model_name: str = "fake-llm", seed: int = 0, time_scale: float = 1.0) -> None:
    """Serve the fake backend on ``host:port`` until cancelled."""
    app = build_app(model, replicas=replicas, model_name=model_name, seed=seed,
                    time_scale=time_scale)
    runner = web.AppRunner(app, handler_cancellation=True, access_log_class=_AccessLog)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
