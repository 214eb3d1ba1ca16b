import json
import time
from typing import Any

import pytest

from extproc.config import Api
from extproc.errors import BadRequest, UnsupportedMedia
from extproc.gateway.request import check_content_type, parse


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def chat(**extra: Any) -> bytes:
    return body({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def test_chat_with_string_content() -> None:
    r = parse(Api.OPENAI_CHAT, body({
        "model": "llama", "stream": True, "max_tokens": 64,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hello"}],
    }))
    assert (r.model, r.texts, r.messages, r.max_tokens, r.stream) == (
        "llama", ("be brief", "hello"), 2, 64, True)


def test_chat_content_parts_count_text_and_charge_other_parts() -> None:
    r = parse(Api.OPENAI_CHAT, body({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "this picture?"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]}]}))
    assert r.texts == ("what is in", "this picture?")
    assert r.non_text_parts == 2


def test_chat_null_content_with_tool_calls_counts_arguments_and_tools() -> None:
    r = parse(Api.OPENAI_CHAT, body({
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function",
             "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}],
    }))
    assert r.texts[0] == "{\"x\": 1}"
    assert "function" in r.texts[1]


def test_max_completion_tokens_wins_over_max_tokens_and_n_multiplies() -> None:
    r = parse(Api.OPENAI_CHAT, chat(max_tokens=10, max_completion_tokens=20, n=3))
    assert r.max_tokens == 20 and r.choices == 3


def test_best_of_decodes_that_many_sequences_and_ignore_eos_or_min_tokens_set_a_least() -> None:
    r = parse(Api.OPENAI_COMPLETIONS, body({"model": "m", "prompt": ["a", "b"], "n": 2,
                                            "best_of": 5, "max_tokens": 50, "min_tokens": 20}))
    assert (r.choices, r.min_tokens, r.ignore_eos) == (10, 20, False)
    r = parse(Api.OPENAI_CHAT, chat(max_tokens=40, ignore_eos=True))
    assert (r.choices, r.min_tokens, r.ignore_eos) == (1, 0, True)
    tgi = parse(Api.TGI_GENERATE, body({"inputs": "x", "parameters": {"best_of": 2}}),
                path="/generate")
    assert tgi.choices == 2


@pytest.mark.parametrize("fields, param", [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": "10"}, "min_tokens"),
    ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"best_of": 0}, "best_of"),
])
def test_what_sets_the_least_or_the_sequences_is_400_when_unusable(fields: dict[str, Any],
                                                                  param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse(Api.OPENAI_CHAT, chat(**fields))
    assert err.value.param == param


def test_the_responses_api_counts_every_text_of_its_input_and_not_its_images() -> None:
    r = parse(Api.OPENAI_RESPONSES, body({
        "model": "m", "instructions": "be brief", "max_output_tokens": 50, "stream": True,
        "tools": [{"type": "function", "name": "f", "description": "looks things up"}],
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "hello there"},
            {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 10_000}]},
                  {"type": "function_call_output", "call_id": "c1", "output": "42 results"}]}))
    assert sorted(r.texts) == ["42 results", "be brief", "hello there", "looks things up"]
    assert (r.max_tokens, r.stream, r.non_text_parts, r.messages) == (50, True, 1, 2)
    assert parse(Api.OPENAI_RESPONSES, body({"model": "m", "input": "hi"})).texts == ("hi",)


def test_the_messages_api_counts_system_messages_and_tools() -> None:
    r = parse(Api.ANTHROPIC_MESSAGES, body({
        "model": "m", "max_tokens": 30, "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                        "name": "f", "input": {"q": "x"}}]},
                     {"role": "user", "content": [
                         {"type": "image", "source": {"type": "base64", "data": "A" * 999}},
                         {"type": "tool_result", "tool_use_id": "t", "content": "found"}]}]}))
    assert sorted(r.texts) == ["found", "hi", "sys", "x"]
    assert (r.max_tokens, r.non_text_parts, r.messages) == (30, 1, 3)


@pytest.mark.parametrize("doc, api_of", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "chat"),
    ({"model": "m", "prompt": ["a", "b"]}, "completions"),
    ({"model": "m", "input": "x"}, "embeddings"),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "tgi"),
])
def test_invocations_are_read_as_the_request_their_body_is(doc: dict[str, Any],
                                                           api_of: str) -> None:
    r = parse(Api.SAGEMAKER_INVOCATIONS, body(doc))
    assert (r.choices, r.prefill_only) == {"chat": (2, False), "completions": (2, False),
                                           "embeddings": (0, True), "tgi": (2, False)}[api_of]


def test_a_pooling_request_prefills_its_query_once_per_document() -> None:
    r = parse(Api.POOLING, body({"model": "r", "query": "q", "documents": ["d1", "d2", "d3"]}))
    assert sorted(r.texts) == ["d1", "d2", "d3", "q", "q", "q"]
    assert (r.prefill_only, r.choices) == (True, 0)
    assert sorted(parse(Api.POOLING, body({"text_1": "a", "text_2": ["b", "c"]})).texts) == [
        "a", "a", "b", "c"]
    with pytest.raises(BadRequest):
        parse(Api.POOLING, body({"model": "r"}))


@pytest.mark.parametrize("api, doc, param", [
    (Api.OPENAI_RESPONSES, {"model": "m", "input": []}, "input"),
    (Api.OPENAI_RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 0},
     "max_output_tokens"),
    (Api.ANTHROPIC_MESSAGES, {"model": "m", "messages": "hi"}, "messages"),
    (Api.SAGEMAKER_INVOCATIONS, {"model": "m", "text": "hi"}, None),
])
def test_unusable_bodies_on_the_other_generation_paths_are_400(api: Api, doc: dict[str, Any],
                                                               param: str | None) -> None:
    with pytest.raises(BadRequest) as err:
        parse(api, body(doc))
    assert err.value.param == param


def test_absent_or_null_max_tokens_means_pool_default() -> None:
    assert parse(Api.OPENAI_CHAT, chat()).max_tokens is None
    assert parse(Api.OPENAI_CHAT, chat(max_tokens=None)).max_tokens is None


@pytest.mark.parametrize("value", [0, -5, 1.5, "100", True, False, [1], {"a": 1}])
def test_invalid_max_tokens_is_400(value: Any) -> None:
    with pytest.raises(BadRequest) as err:
        parse(Api.OPENAI_CHAT, chat(max_tokens=value))
    assert err.value.param == "max_tokens"


@pytest.mark.parametrize("prompt, texts, ids, choices", [
    ("once upon", ("once upon",), 0, 1),
    (["a", "b", "c"], ("a", "b", "c"), 0, 3),
    ([1, 2, 3, 4], (), 4, 1),
    ([[1, 2], [3, 4, 5]], (), 5, 2),
])
def test_completions_prompt_forms(prompt: Any, texts: tuple[str, ...], ids: int,
                                  choices: int) -> None:
    r = parse(Api.OPENAI_COMPLETIONS, body({"model": "m", "prompt": prompt, "max_tokens": 5}))
    assert (r.texts, r.token_ids, r.choices, r.max_tokens) == (texts, ids, choices, 5)


def test_embeddings_are_prefill_only() -> None:
    r = parse(Api.OPENAI_EMBEDDINGS, body({"model": "e", "input": ["x", "y"]}))
    assert r.prefill_only and r.texts == ("x", "y") and r.choices == 0


def test_tgi_generate_and_generate_stream() -> None:
    doc = {"inputs": "hello", "parameters": {"max_new_tokens": 17}}
    plain = parse(Api.TGI_GENERATE, body(doc), path="/generate")
    streamed = parse(Api.TGI_GENERATE, body(doc), path="/generate_stream?x=1")
    assert (plain.texts, plain.max_tokens, plain.stream) == (("hello",), 17, False)
    assert streamed.stream
    with pytest.raises(BadRequest, match="max_new_tokens"):
        parse(Api.TGI_GENERATE, body({"inputs": "x", "parameters": {"max_new_tokens": 0}}))


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "empty"),
    ("not json", b"{model: m}", "not valid JSON"),
    ("truncated", b'{"model": "m", "messages": [', "not valid JSON"),
    ("invalid utf-8", b'{"model": "m\xff\xfe"}', "not valid UTF-8"),
    ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "surrogate"),
    ("NaN", b'{"model": "m", "max_tokens": NaN, "messages": []}', "NaN is not valid JSON"),
    ("Infinity", b'{"model": "m", "max_tokens": Infinity}', "Infinity is not valid JSON"),
    ("huge number", b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "too long"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("duplicate keys", b'{"model": "m", "model": "n", "messages": []}', "duplicate key"),
    ("nested duplicate keys",
     b'{"model": "m", "messages": [{"role": "u", "role": "s", "content": "x"}]}',
     "duplicate key"),
    ("array body", b"[1, 2]", "must be a JSON object"),
    ("no model", body({"messages": [{"role": "user", "content": "x"}]}), "'model'"),
    ("model not a string", body({"model": 3, "messages": []}), "'model'"),
    ("no messages", body({"model": "m"}), "'messages'"),
    ("empty messages", body({"model": "m", "messages": []}), "'messages'"),
    ("message not object", body({"model": "m", "messages": ["hi"]}), "messages[0]"),
    ("role missing", body({"model": "m", "messages": [{"content": "x"}]}), "role"),
    ("content a number", body({"model": "m", "messages": [{"role": "u", "content": 5}]}),
     "content"),
    ("part without type", body({"model": "m", "messages": [{"role": "u", "content": [{}]}]}),
     "type"),
    ("text part not string",
     body({"model": "m", "messages": [{"role": "u", "content": [{"type": "text", "text": 1}]}]}),
     "text"),
    ("stream not bool", chat(stream="yes"), "'stream'"),
    ("n zero", chat(n=0), "'n'"),
    ("tools not array", chat(tools={"a": 1}), "'tools'"),
]


@pytest.mark.parametrize("name, raw, message", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_chat_bodies_are_400_with_a_clear_message(name: str, raw: bytes,
                                                       message: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse(Api.OPENAI_CHAT, raw)
    assert err.value.status == 400
    assert message in err.value.message


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [[1], "a"], [-1], [True]])
def test_bad_completion_prompts_are_400(prompt: Any) -> None:
    with pytest.raises(BadRequest) as err:
        parse(Api.OPENAI_COMPLETIONS, body({"model": "m", "prompt": prompt}))
    assert err.value.param == "prompt"


def test_error_messages_never_quote_the_prompt() -> None:
    canary = "CANARY-7f3a"
    cases = [
        body({"model": "m", "messages": [{"role": "u", "content": canary}], "max_tokens": "x"}),
        body({"model": "m", "messages": [{"role": "u", "content": canary}], "max_tokens": 1,
              "max_tokens2": 1, "stream": canary}),
        ('{"model": "m", "messages": [{"role": "u", "content": "' + canary + '"}').encode(),
        ('{"model": "m", "' + canary + '": 1, "' + canary + '": 2}').encode(),
    ]
    for raw in cases:
        with pytest.raises(BadRequest) as err:
            parse(Api.OPENAI_CHAT, raw)
        assert canary not in err.value.message


@pytest.mark.parametrize("raw, param", [
    (chat(max_tokens=2**31), "max_tokens"),
    (b'{"model": "m", "messages": [{"role": "u", "content": "x"}], "n": 1' + b"0" * 400 + b"}",
     "n"),
    (body({"model": "m", "prompt": "x", "max_tokens": 10**100}), "max_tokens"),
])
def test_counts_beyond_an_int32_are_400(raw: bytes, param: str) -> None:
    """They used to reach the cost model and overflow its floats (an OverflowError: a 500)."""
    api = Api.OPENAI_COMPLETIONS if b'"prompt"' in raw else Api.OPENAI_CHAT
    with pytest.raises(BadRequest) as err:
        parse(api, raw)
    assert err.value.param == param
    assert parse(Api.OPENAI_CHAT, chat(max_tokens=2**31 - 1)).max_tokens == 2**31 - 1


@pytest.mark.parametrize("raw, param", [
    (body({"model": "\ud800", "messages": [{"role": "u", "content": "x"}]}), "model"),
    (chat(tools=[{"type": "function", "function": {"name": "\udfff"}}]), "tools"),
    (body({"model": "\ud800", "inputs": "x"}), "model"),
])
def test_lone_surrogates_in_the_model_and_tools_are_400(raw: bytes, param: str) -> None:
    api = Api.TGI_GENERATE if b'"inputs"' in raw else Api.OPENAI_CHAT
    with pytest.raises(BadRequest) as err:
        parse(api, raw)
    assert err.value.param == param and "surrogate" in err.value.message


def test_a_body_of_too_many_containers_is_refused_before_it_is_parsed() -> None:
    raw = b'{"model": "m", "messages": [' + b",".join([b"[]"] * 600_000) + b"]}"
    started = time.perf_counter()
    with pytest.raises(BadRequest) as err:
        parse(Api.OPENAI_CHAT, raw)
    assert time.perf_counter() - started < 0.1  # parsing it takes ~0.5-1.5 s
    assert err.value.code == "too_complex"
    # brackets are counted anywhere, even in strings: 500,000 still pass
    ok = body({"model": "m", "messages": [{"role": "u", "content": "[" * 499_990}]})
    assert parse(Api.OPENAI_CHAT, ok).texts == ("[" * 499_990,)


def test_100000_content_parts_are_costed_in_linear_time() -> None:
    def seconds(n: int) -> float:
        raw = body({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello"}] * n}]})
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            assert len(parse(Api.OPENAI_CHAT, raw).texts) == n
            best = min(best, time.perf_counter() - started)
        return best

    small, large = seconds(20_000), seconds(100_000)
    assert large < 2.0
    assert large / small < 15, (small, large)  # 5x the parts: linear ~5x, quadratic ~25x


@pytest.mark.parametrize("value", [
    None, "", "application/json", "Application/JSON; charset=UTF-8",
    'application/json; charset="utf-8"', "application/json;charset=utf8",
    "application/vnd.openai+json", "application/json; boundary=x",
])
def test_json_content_types_are_accepted(value: str | None) -> None:
    check_content_type(value)


@pytest.mark.parametrize("value", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "text/json", "application/jsonx", "json", "application/json; charset=utf-16",
    "application/json; charset=latin-1", "*/*",
])
def test_other_content_types_are_415(value: str) -> None:
    with pytest.raises(UnsupportedMedia) as err:
        check_content_type(value)
    assert err.value.status == 415 and err.value.code == "unsupported_media_type"
