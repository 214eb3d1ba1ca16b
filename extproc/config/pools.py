"""A pool of replicas: its engine model (a preset and keys over it), its engine scrapes, where
its ready replicas come from, and the autoscaling thresholds of its recommender."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Self, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
    model_validator,
)
from pydantic.dataclasses import dataclass

from extproc.config.fields import (
    MODEL,
    Count,
    File,
    Flag,
    Fraction,
    Int,
    Named,
    NonNegative,
    Num,
    Positive,
    Text,
)
from extproc.config.rules import Problem, Rule, Section, early, fail, problem, within
from extproc.errors import ConfigError
from extproc.fleet.engine import PRESETS, EngineModel
from extproc.scaling.autoscale import ScalingPolicy

FROM_CAPACITY = "from_capacity"


def _target(v: str) -> str | None:
    scheme, sep, rest = v.partition("://")
    if sep:
        ok = scheme in ("http", "https") and bool(rest)
    else:
        host, _, port = v.rpartition(":")
        ok = bool(host) and port.isdigit()
    return None if ok else "must be HOST:PORT or an http(s):// URL"


def _from_capacity(value: Any) -> Any:
    if value is None or value == FROM_CAPACITY:
        return None
    if not (isinstance(value, list) and value):
        raise problem(f"must be a non-empty list of HOST:PORT or http(s):// URLs,"
                      f" or {FROM_CAPACITY!r}")
    return value


def _distinct_targets(v: tuple[str, ...] | None) -> str | None:
    dups = sorted({t for t in v or () if v and v.count(t) > 1})
    return f"duplicate target {dups[0]!r} (it would be counted twice)" if dups else None


Targets = Annotated[
    tuple[Annotated[Text, Rule(_target)], ...] | None,
    BeforeValidator(_from_capacity), Rule(_distinct_targets, quote=False),
    WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1},
                               "minItems": 1, "uniqueItems": True},
                              {"const": FROM_CAPACITY}]})]


@dataclass(frozen=True, config=MODEL)
class EngineMetricsConfig:
    """Scraping a pool's engines for their own queues (``extproc.fleet.enginestats``): a correction
    to the ledger's view that only ever tightens admission, and never while stale."""

    targets: Targets = Field(default=None, json_schema_extra={"default": FROM_CAPACITY})
    """Replicas to scrape (HOST:PORT or http(s):// base URLs), or from_capacity: the capacity
    source's ready hosts (not with capacity.source static)."""
    interval_s: Positive = 2.0
    """Between the end of one scrape round and the next."""
    timeout_s: Positive = 0.5
    """Per replica."""
    max_age_s: Positive = 5.0
    """A replica's last sample counts this long (at least interval_s + timeout_s)."""
    min_coverage: Fraction = 0.5
    """Fresh samples / targets below this: the pool is stale and decided on the ledger alone."""
    tolerance: NonNegative = 0.25
    """Engines may hold this much more than the ledger ..."""
    slack: Count = 2
    """... plus this many requests, before the excess counts as work the ledger does not see."""
    learn_output_lengths: Flag = True
    """Learn the pool's output lengths from vllm:request_generation_tokens, and the speed a
    cancelled stream's answer is estimated at from vllm:time_to_first_token_seconds and
    vllm:inter_token_latency_seconds."""
    idle_destination: Flag = True
    """Read the replica an endpoint picker before ext_proc chose for a request (Envoy
    metadata envoy.lb, x-gateway-destination-endpoint): admit a request the model refuses when
    that replica reports nothing running or waiting, and start it after the queue it reports
    (off: the least-waiting replica's queue)."""

    @model_validator(mode="after")
    def _samples_outlive_a_round(self) -> Self:
        # A sample must outlive the next round (which may take the whole timeout), or the
        # pool would go stale between two good scrapes.
        if self.max_age_s < self.interval_s + self.timeout_s:
            fail([Problem(("max_age_s",), f"must be >= interval_s + timeout_s"
                          f" ({self.interval_s + self.timeout_s:g}) (got {self.max_age_s:g})",
                          show=False)])
        return self


DEFAULT_PRESET = "llama-70b-fp8-2xh100"
_ENGINE_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")
_STEP = "Step time (one forward pass, linear in what it holds): ms "
_ENGINE_DOCS = {
    "max_num_seqs": "vLLM --max-num-seqs: sequences one replica runs at once at most.",
    "max_num_batched_tokens": "vLLM --max-num-batched-tokens: a step's token budget, decodes"
                              " and prefill chunks together.",
    "block_size": "vLLM --block-size: tokens per KV cache block.",
    "num_gpu_blocks": "KV cache blocks of one replica (vLLM's num_gpu_blocks); 0: unlimited.",
    "max_model_len": "vLLM --max-model-len: prompt + output of one sequence at most.",
    "prefix_caching": "vLLM --enable-prefix-caching: a cached shared prefix is not computed"
                      " again.",
    "step_base_ms": _STEP + "of every step (the weights read once).",
    "ms_per_token": _STEP + "per token scheduled, prefill chunk tokens and decodes alike.",
    "ms_per_seq": _STEP + "per decoding sequence (sampling, per-sequence kernels).",
    "ms_per_kv_token": _STEP + "per token of context the decodes read from the KV cache.",
    "ms_per_prefill_pair": _STEP + "per query-key pair of prefill attention.",
}


def _engine_key(f: dataclasses.Field[Any]) -> Any:
    kind = type(getattr(EngineModel(), f.name))
    typed: Any = {bool: Flag, int: Int, float: Num}[kind]
    if kind is not bool:
        typed = Annotated[typed, within(gt=0) if f.name in _ENGINE_COUNTS else within(ge=0)]
    return (typed | None, Field(default=None, description=_ENGINE_DOCS[f.name] + " Default: the"
                                " preset's."))


_ENGINE_SECTION: type[BaseModel] = create_model(
    "Engine", __config__=ConfigDict(extra="forbid"),
    preset=(cast(Any, Literal)[tuple(PRESETS)], Field(default=DEFAULT_PRESET, description=(
        "The calibrated engine the other keys start from (extproc/fleet/engine.py): "
        + ", ".join(PRESETS) + "."))),
    **{f.name: _engine_key(f) for f in dataclasses.fields(EngineModel)})


def _engine(section: BaseModel) -> EngineModel:
    values = section.model_dump(exclude_none=True)
    return dataclasses.replace(PRESETS[values.pop("preset")], **values)


# Pool keys of the first cost model, now in the engine section under vLLM's names.
_MOVED_TO_ENGINE = {"max_running": "max_num_seqs", "prefill_ms_per_token": "ms_per_token",
                    "itl_ms_at_1": "step_base_ms", "itl_ms_per_running": "ms_per_seq"}


@dataclass(frozen=True, config=MODEL)
class Pool:
    """Replicas serving one model, and the model of one replica (``extproc.fleet.engine``)."""

    name: Named
    """Named in capacity.services, metrics and autoscaling."""
    models: Annotated[tuple[Text, ...], Rule(lambda v: None if v else "must not be empty",
                                             minItems=1)] = ("*",)
    """Model names it serves; * serves any model no pool names."""
    replicas: Count = 1
    """Ready replicas assumed (capacity.source static)."""
    engine: Annotated[EngineModel, Section(_ENGINE_SECTION, _engine)] = Field(
        default_factory=EngineModel)
    """One replica as vLLM V1 runs it: a preset and any of its keys over it
    (extproc/fleet/engine.py)."""
    default_max_tokens: Annotated[Int, within(gt=0)] = 512
    """Output tokens charged when a request names no max_tokens."""
    tokenizer: File | None = None
    """A tokenizer.json for exact prompt counts; absent: estimated from bytes_per_token."""
    bytes_per_token: Positive = 4.0
    """UTF-8 bytes per prompt token, when estimating."""
    message_overhead_tokens: Count = 4
    """Tokens a chat message adds beyond its text."""
    non_text_part_tokens: Count = 765
    """Tokens charged for a non-text content part (an image)."""
    # Output-length prediction (extproc.tokens.estimate): the mean and a long (~99th percentile)
    # output of this pool's requests, e.g. from the engines' generation-token histogram.
    expected_output_tokens: Positive | None = None
    """Mean output of its requests; absent: max_tokens charged in full."""
    long_output_tokens: Positive | None = None
    """A long (~99th percentile) output, at least expected_output_tokens."""
    wait_quantile: Annotated[Num, within(ge=0.5, lt=1)] = 0.97
    """How sure a predicted queue wait must be: its quantile."""
    engine_metrics: EngineMetricsConfig | None = None
    """Scrape the engines' /metrics as a correction to the ledger's view; absent: off."""

    def serves(self, model: str) -> bool:
        return model in self.models or "*" in self.models

    @model_validator(mode="wrap")
    @classmethod
    def _first_cost_model_keys(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        """Pool keys of the first cost model say where they went (not just "unknown key")."""
        found = [Problem((old,), f"moved to engine.{new} (see extproc.fleet.engine)", show=False)
                 for old, new in _MOVED_TO_ENGINE.items()
                 if isinstance(raw, Mapping) and old in raw]
        return cast(Self, early(raw, handler, found, drop=_MOVED_TO_ENGINE))

    @model_validator(mode="after")
    def _long_is_not_below_the_mean(self) -> Self:
        mean, long = self.expected_output_tokens, self.long_output_tokens
        if mean is not None and long is not None and long < mean:
            fail([Problem(("long_output_tokens",), f"must be >= expected_output_tokens"
                          f" ({mean:g}) (got {long:g})", show=False)])
        return self


@dataclass(frozen=True, config=MODEL)
class CapacityConfig:
    """Where ready replicas come from (see extproc.fleet.capacity)."""

    source: Literal["static", "envoy", "kubernetes"] = "static"
    """static: pools[].replicas; envoy: Envoy admin's healthy hosts; kubernetes: each pool's Service
    endpoints."""
    envoy_admin_url: Annotated[Text, Rule(lambda v: None if v.startswith("http://")
                                          else "must be http://", pattern="^http://")] = (
        "http://127.0.0.1:9901")
    """Envoy's admin interface (source envoy)."""
    services: Mapping[str, Annotated[Text, Rule(
        lambda v: None if v.count("/") == 1 else "must be 'namespace/service'",
        pattern="^[^/]+/[^/]+$")]] = Field(default_factory=dict)
    """Pool name -> namespace/service (source kubernetes)."""
    hold_s: NonNegative = 10.0
    """Keep the last value this long when the source fails ..."""
    floor: Count = 1
    """... then assume at most this many ready replicas."""


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
    window_s: float = 15.0  # the control window
    policy: ScalingPolicy = dataclasses.field(default_factory=ScalingPolicy)


def _line_comments(cls: type) -> dict[str, str]:
    """The comment on each field's line of ``cls``: ScalingPolicy documents its keys so."""
    lines = inspect.getsource(cls).splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\w+): [^#]*#\s*(.+)", ln) for ln in lines) if m}


def _policy_key(f: dataclasses.Field[Any], doc: str) -> Any:
    typed: Any = {int: Int, float: Num}.get(type(f.default), Num | None)
    return (typed, Field(default=f.default, description=doc))


_AUTOSCALE_SECTION: type[BaseModel] = create_model(
    "Autoscale", __config__=ConfigDict(extra="forbid"),
    window_s=(Positive, Field(default=15.0, description="The control window.")),
    **{f.name: _policy_key(f, doc.get(f.name, "")) for doc in [_line_comments(ScalingPolicy)]
       for f in dataclasses.fields(ScalingPolicy)})


def _autoscale(section: BaseModel) -> AutoscaleConfig:
    """``window_s`` plus any field of ``ScalingPolicy``, validated by it."""
    values = section.model_dump()
    window_s = values.pop("window_s")
    try:
        return AutoscaleConfig(window_s=window_s, policy=ScalingPolicy(**values))
    except ConfigError as exc:
        fail([Problem(tuple(key.split(".")[1:]), why, show=False)
              for key, _, why in (line.partition(": ") for line in exc.problems)])


Autoscale = Annotated[AutoscaleConfig, Section(_AUTOSCALE_SECTION, _autoscale)]
