"""Turn an HTTP request body into the few facts admission needs.

Supported shapes (``Api``):
- OpenAI ``/v1/chat/completions``: ``messages`` with string content or content-part arrays
  (text parts are counted; image/audio/file parts are charged a flat cost per part),
  ``tools`` definitions, ``max_completion_tokens`` or ``max_tokens``, ``n`` (or ``best_of``,
  when larger: the sequences decoded), ``stream``, and vLLM's ``min_tokens`` and
  ``ignore_eos`` (what each sequence writes at least).
- OpenAI ``/v1/completions``: ``prompt`` as a string, a list of strings, a token-id list or a
  list of token-id lists (each prompt yields its own completions), ``max_tokens``, ``n``,
  ``best_of``, ``min_tokens``, ``ignore_eos``.
- OpenAI ``/v1/embeddings``: ``input`` in the same forms; prefill only.
- TGI ``/generate`` and ``/generate_stream``: ``inputs``, ``parameters.max_new_tokens`` and
  ``parameters.best_of``.
- OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``),
  which vLLM serves as well: every string of their input but the labels (``_strings``) is
  prompt; ``max_output_tokens`` / ``max_tokens``. A Responses request's
  ``previous_response_id`` is not read: the conversation vLLM stores for it (only with
  ``VLLM_ENABLE_RESPONSES_API_STORE=1``, off by default) is not in the body.
- SageMaker's ``/invocations``: a chat, completion, embedding or TGI body, as its keys say.
- vLLM's pooling paths (``/pooling``, ``/classify``, ``/score``, ``/rerank``): prefill only,
  every string but the labels, a query once per document it is scored against.

Anything unusable raises ``BadRequest`` with a message that names the field and never quotes
the prompt. Ambiguous JSON is refused rather than guessed at: duplicate keys (the inference
server might read the other copy than we costed), NaN/Infinity, numbers too long to convert,
nesting too deep to parse, invalid UTF-8 and lone surrogates (in prompt text, tools and the
model name). Counts (``max_tokens``, ``n``...) above ``MAX_COUNT`` are refused: no engine takes
them, and the cost model works in floats.

Hostile shapes are bounded before they cost time. Parsing is linear in the body, but the
constant differs a hundredfold: a megabyte of prompt text parses in ~3 ms, a megabyte of
``[],`` (350,000 empty arrays) in 0.15-0.4 s on a loaded 2-core machine, all of it on the
event loop that serves every other stream (and Envoy gives a phase 2 s). So a body with more
than ``MAX_CONTAINERS`` ``[`` and ``{`` bytes is refused before it is parsed: a byte count, so
brackets inside strings count too, but 500,000 of them are 6 % of a default-size (8 MiB)
body, far denser than code or JSON pasted into a prompt. 100,000 content parts, say, still
parse and are costed in well under a second.

``check_content_type`` is the rule for the ``Content-Type`` header of an admission route:
absent, ``application/json`` or ``application/*+json`` (with no charset, or UTF-8); anything
else is a 415, because the inference server would not read the body as JSON either (FastAPI,
behind vLLM, does not; TGI wants ``application/json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.config import Api, Config, TenantSource, canonical_path
from extproc.errors import BadRequest, UnsupportedMedia

MAX_PROMPTS = 4096  # list prompts / embedding inputs per request
MAX_COUNT = 2**31 - 1  # max_tokens, n...: an engine's int32
MAX_CONTAINERS = 500_000  # '[' and '{' bytes in a body (module docstring)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What a request asks of the GPU. ``texts`` holds prompt text: never log or export it."""

    model: str
    texts: tuple[str, ...] = field(repr=False)
    token_ids: int = 0  # prompt tokens given directly as ids
    messages: int = 0  # chat messages (each costs a template overhead)
    non_text_parts: int = 0  # images, audio, files: charged a flat cost each
    max_tokens: int | None = None  # None: the pool's default applies
    choices: int = 1  # sequences generated per request (n or best_of, x prompts)
    min_tokens: int = 0  # each writes at least this many (vLLM's ``min_tokens``) ...
    ignore_eos: bool = False  # ... or all of ``max_tokens`` (``ignore_eos``)
    stream: bool = False
    prefill_only: bool = False
    # A digest of the body (its retries are byte for byte the same: ``decision.retries``);
    # never logged or exported.
    fingerprint: str | None = field(default=None, repr=False, compare=False)


def parse(api: Api, body: bytes, *, path: str = "") -> InferenceRequest:
    doc = _load(body)
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    if api is Api.TGI_GENERATE:
        request = _tgi(doc, stream=canonical_path(path).endswith("_stream"))
    else:
        request = _READERS[api](doc)
    # SHA-256 (hardware-accelerated): 25 us for a 20 KB body where BLAKE2b took 48 and its
    # JSON parse 29, on the 2-core development machine
    fingerprint = hashlib.sha256(body).hexdigest()[:32]
    return dataclasses.replace(request, fingerprint=f"{api.value}:{fingerprint}")


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):  # the key is not quoted back: it may be client content
        raise BadRequest("a JSON object has a duplicate key", code="duplicate_key")
    return doc


def check_content_type(value: str | None) -> None:
    """Raise ``UnsupportedMedia`` unless the body is declared JSON in UTF-8 (or undeclared)."""
    if value is None or not value.strip():
        return
    media, *params = (p.strip().lower() for p in value.split(";"))
    kind, _, subtype = media.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMedia("Content-Type must be application/json",
                               code="unsupported_media_type")
    for param in params:
        name, _, charset = param.partition("=")
        if name.strip() == "charset" and charset.strip().strip('"') not in ("utf-8", "utf8"):
            raise UnsupportedMedia("request bodies must be encoded in UTF-8",
                                   code="unsupported_media_type")


def forwarded_headers(config: Config) -> tuple[str, ...]:
    """The request headers the sidecar reads (server.py, gate.py, tenant.py, telemetry.py), the only
    ones Envoy sends it (``extproc.gateway.envoyconf``). Pseudo-headers count as headers for Envoy's
    matcher."""
    names = [":path", ":method", "content-type", "content-length", "content-encoding",
             config.deadline_header, "traceparent", "tracestate"]
    if config.tenant.source is TenantSource.HEADER:
        names.append(config.tenant.header)
    if config.priority.header is not None:
        names.append(config.priority.header)
    return tuple(dict.fromkeys(name.lower() for name in names))


# One trip (``extproc.gateway.envoyconf``): the request's headers are not sent, its body comes with
# Envoy's attributes, these CEL expressions for the headers the sidecar reads and the time the
# request began (its wait: extproc.gateway.server), in ``ProcessingRequest.attributes`` under the
# filter's name. A header sent twice arrives as one value joined by commas.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
REQUEST_TIME = "request.time"
_PSEUDO = {":path": "request.path", ":method": "request.method"}


def header_attribute(name: str) -> str:
    """The attribute Envoy sends a request header's value as (``name`` lower-case)."""
    return _PSEUDO.get(name) or f'request.headers["{name}"]'


def headers_from_attributes(attributes: Any, names: Sequence[str]) -> dict[str, str]:
    """The headers among ``names`` that the request had, from the ``Struct`` of attributes
    (a header it lacked, or a value that is not a string, is left out)."""
    fields = attributes.fields
    out = {}
    for name in names:
        key = header_attribute(name)
        if key in fields and fields[key].WhichOneof("kind") == "string_value":
            out[name] = fields[key].string_value
    return out


def deadline_ms(headers: Mapping[str, str], header: str) -> float | None:
    """The client's deadline header (``header``) in ms, if sent: it can only tighten the
    class deadline. Raises ``BadRequest`` unless a positive, finite number."""
    raw = headers.get(header)
    if raw is None:
        return None
    try:
        asked = float(raw)
    except ValueError:
        asked = float("nan")
    if not asked > 0 or asked == float("inf"):
        raise BadRequest(f"header {header} must be a positive number of milliseconds")
    return asked


def _load(body: bytes) -> Any:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    if body.count(b"[") + body.count(b"{") > MAX_CONTAINERS:
        raise BadRequest(f"request body has more than {MAX_CONTAINERS} '[' and '{{' characters"
                         " (JSON arrays and objects)", code="too_complex")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg} at offset {exc.pos}",
                         code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:  # int too long to convert (int_max_str_digits)
        raise BadRequest("request body has a number too long to parse") from None


def _text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{param}' contains an invalid (lone surrogate) character",
                         param=param) from None
    return value


def _model(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return _text(model, "model")


def _positive_int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer", param=key)
    if value <= 0:
        raise BadRequest(f"'{key}' must be greater than 0", param=key)
    if value > MAX_COUNT:
        raise BadRequest(f"'{key}' must be at most {MAX_COUNT}", param=key)
    return value


def _sequences(doc: dict[str, Any]) -> int:
    """The sequences the engine decodes for each prompt: ``n``, or ``best_of`` when larger
    (it decodes ``best_of`` and returns the best ``n``)."""
    return max(_positive_int(doc, "n") or 1, _positive_int(doc, "best_of") or 1)


def _least(doc: dict[str, Any], max_tokens: int | None) -> int:
    """``min_tokens``: each sequence writes at least this many (0 when absent); at most
    ``max_tokens``, as the engine requires."""
    value = doc.get("min_tokens")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest("'min_tokens' must be a non-negative integer", param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise BadRequest("'min_tokens' must be at most 'max_tokens'", param="min_tokens")
    if value > MAX_COUNT:
        raise BadRequest(f"'min_tokens' must be at most {MAX_COUNT}", param="min_tokens")
    return value


def _bool(doc: dict[str, Any], key: str) -> bool:
    value = doc.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean", param=key)
    return value


def _chat(doc: dict[str, Any]) -> InferenceRequest:
    model = _model(doc)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    texts: list[str] = []
    non_text = 0
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{param}' must be an object", param=param)
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'{param}.role' must be a string", param=f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            texts.append(_text(content, f"{param}.content"))
        elif isinstance(content, list):
            non_text += _parts(content, f"{param}.content", texts)
        elif content is not None:
            raise BadRequest(f"'{param}.content' must be a string or an array of parts",
                             param=f"{param}.content")
        for call in _list(message.get("tool_calls"), f"{param}.tool_calls"):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                texts.append(_text(arguments, f"{param}.tool_calls"))
    tools = doc.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array", param="tools")
        texts.append(_text(json.dumps(tools, ensure_ascii=False), "tools"))
    max_tokens = _positive_int(doc, "max_completion_tokens") or _positive_int(doc, "max_tokens")
    return InferenceRequest(
        model=model,
        texts=tuple(texts),
        messages=len(messages),
        non_text_parts=non_text,
        max_tokens=max_tokens,
        choices=_sequences(doc),
        stream=_bool(doc, "stream"),
        min_tokens=_least(doc, max_tokens),
        ignore_eos=_bool(doc, "ignore_eos"),
    )


def _list(value: Any, param: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"'{param}' must be an array", param=param)
    return value


def _parts(parts: list[Any], param: str, texts: list[str]) -> int:
    """Append text parts to ``texts``; return how many non-text parts there were."""
    non_text = 0
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRequest(f"'{where}' must be an object with a string 'type'", param=where)
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"'{where}.text' must be a string", param=f"{where}.text")
            texts.append(_text(text, f"{where}.text"))
        else:
            non_text += 1
    return non_text


def _prompts(value: Any, param: str) -> tuple[list[str], int, int]:
    """Prompts as (texts, token-id count, number of prompts) from the four OpenAI forms."""
    if isinstance(value, str):
        return [_text(value, param)], 0, 1
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{param}' must be a string or a non-empty array", param=param)
    if len(value) > MAX_PROMPTS:
        raise BadRequest(f"'{param}' has more than {MAX_PROMPTS} items", param=param)
    if all(isinstance(v, str) for v in value):
        return [_text(v, param) for v in value], 0, len(value)
    if all(_is_token_id(v) for v in value):
        return [], len(value), 1
    if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
        return [], sum(len(v) for v in value), len(value)
    raise BadRequest(
        f"'{param}' must be a string, an array of strings, an array of token ids, or an"
        " array of token-id arrays",
        param=param,
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _completions(doc: dict[str, Any]) -> InferenceRequest:
    model = _model(doc)
    if "prompt" not in doc:
        raise BadRequest("'prompt' is required", param="prompt")
    texts, ids, prompts = _prompts(doc["prompt"], "prompt")
    max_tokens = _positive_int(doc, "max_tokens")
    return InferenceRequest(
        model=model,
        texts=tuple(texts),
        token_ids=ids,
        max_tokens=max_tokens,
        choices=prompts * _sequences(doc),
        stream=_bool(doc, "stream"),
        min_tokens=_least(doc, max_tokens),
        ignore_eos=_bool(doc, "ignore_eos"),
    )


# Keys whose strings name a shape, not text a model reads (``_strings``).
_LABELS = frozenset({"type", "role", "id", "call_id", "status", "name", "model",
                     "media_type", "cache_control", "tool_use_id", "signature"})


# Blocks that carry an image, audio or a file (charged a flat cost each, as chat's parts).
_MEDIA = frozenset({"image", "input_image", "image_url", "input_audio", "input_file", "document",
                    "file", "audio"})


def _strings(value: Any, param: str, out: list[str]) -> int:
    """Every string in ``value`` but the labels (``_LABELS``), the text of a request whose
    items take many shapes (messages, content blocks, tool calls and results), counted as
    prompt; returns the media blocks (``_MEDIA``), whose bytes are not text. A label counted
    costs a token or two; a text left out would be a way around."""
    media = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(_text(item, param))
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") in _MEDIA:
                media += 1
            else:
                stack.extend(v for k, v in item.items() if k not in _LABELS)
    return media


def _responses(doc: dict[str, Any]) -> InferenceRequest:
    """OpenAI's Responses API (vLLM's ``/v1/responses``): ``input`` (a string or items),
    ``instructions``, ``tools``, ``max_output_tokens``."""
    model = _model(doc)
    if not isinstance(doc.get("input"), (str, list)) or not doc["input"]:
        raise BadRequest("'input' must be a non-empty string or array", param="input")
    texts: list[str] = []
    media = sum(_strings(doc.get(key), key, texts) for key in ("input", "instructions", "tools"))
    items = doc["input"]
    return InferenceRequest(
        model=model, texts=tuple(texts), messages=len(items) if isinstance(items, list) else 1,
        non_text_parts=media, max_tokens=_positive_int(doc, "max_output_tokens"),
        stream=_bool(doc, "stream"))


def _messages(doc: dict[str, Any]) -> InferenceRequest:
    """Anthropic's Messages API (vLLM's ``/v1/messages``): ``messages`` whose content is a
    string or blocks, ``system``, ``tools``, ``max_tokens``."""
    model = _model(doc)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    texts: list[str] = []
    media = sum(_strings(doc.get(key), key, texts) for key in ("messages", "system", "tools"))
    max_tokens = _positive_int(doc, "max_tokens")
    return InferenceRequest(
        model=model, texts=tuple(texts), messages=len(messages), non_text_parts=media,
        max_tokens=max_tokens, stream=_bool(doc, "stream"), min_tokens=_least(doc, max_tokens))


def _pooling(doc: dict[str, Any]) -> InferenceRequest:
    """vLLM's pooling models (``/pooling``, ``/classify``, ``/score``, ``/rerank``): prefill
    only, every string but the labels. A query scored against ``n`` documents is prefilled
    with each of them, ``n`` times (``query`` / ``text_1`` beside a list)."""
    model = doc.get("model") or ""
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    texts: list[str] = []
    for one, many in (("query", "documents"), ("text_1", "text_2"), ("queries", "documents")):
        if isinstance(doc.get(one), str) and isinstance(doc.get(many), list):
            texts.extend([_text(doc[one], one)] * max(0, len(doc[many]) - 1))
    media = _strings(doc, "input", texts)  # and every text once (``model`` is a label)
    if not texts and not media:
        raise BadRequest("a pooling request must carry text to read")
    return InferenceRequest(model=_text(model, "model"), texts=tuple(texts), choices=0,
                            non_text_parts=media, prefill_only=True)


def _invocations(doc: dict[str, Any]) -> InferenceRequest:
    """SageMaker's ``/invocations`` (vLLM and TGI serve it): a chat, completion or embedding
    request, told apart by its body as vLLM tells them, or TGI's ``inputs``."""
    if "inputs" in doc:
        return _tgi(doc, stream=False)
    if "messages" in doc:
        return _chat(doc)
    if "prompt" in doc:
        return _completions(doc)
    if "input" in doc:
        return _embeddings(doc)
    raise BadRequest("an /invocations body must be a chat ('messages'), completion ('prompt'),"
                     " embedding ('input') or TGI ('inputs') request")


def _embeddings(doc: dict[str, Any]) -> InferenceRequest:
    model = _model(doc)
    if "input" not in doc:
        raise BadRequest("'input' is required", param="input")
    texts, ids, _ = _prompts(doc["input"], "input")
    return InferenceRequest(
        model=model, texts=tuple(texts), token_ids=ids, choices=0, prefill_only=True
    )


def _tgi(doc: dict[str, Any], *, stream: bool) -> InferenceRequest:
    inputs = doc.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequest("'inputs' is required and must be a string", param="inputs")
    params = doc.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object", param="parameters")
    model = doc.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return InferenceRequest(
        model=_text(model, "model"),
        texts=(_text(inputs, "inputs"),),
        max_tokens=_positive_int(params, "max_new_tokens"),
        choices=_positive_int(params, "best_of") or 1,  # TGI decodes them all, returns one
        stream=stream or _bool(doc, "stream"),
    )


_READERS: dict[Api, Callable[[dict[str, Any]], InferenceRequest]] = {
    Api.OPENAI_CHAT: _chat, Api.OPENAI_COMPLETIONS: _completions,
    Api.OPENAI_EMBEDDINGS: _embeddings, Api.OPENAI_RESPONSES: _responses,
    Api.ANTHROPIC_MESSAGES: _messages, Api.SAGEMAKER_INVOCATIONS: _invocations,
    Api.POOLING: _pooling,
}
