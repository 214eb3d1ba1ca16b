"""The generated parts of the configuration (extproc.config.schema) match the models: the chart's
values.schema.json and the README's reference are what the generator writes today, and the
models and the schema accept and refuse the same values, key by key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from extproc import config
from extproc.config import schema as configschema
from extproc.config.rules import dotted
from extproc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = configschema.schema()
CHECK = jsonschema.Draft7Validator(SCHEMA)
CHART_CONFIG = yaml.safe_load((ROOT / "helm" / "extproc" / "values.yaml").read_text())["config"]


def problems(raw: Any) -> list[str]:
    try:
        config.from_mapping(raw)
    except ConfigError as exc:
        return exc.problems
    return []


def test_the_chart_schema_is_the_generated_one() -> None:
    committed = configschema.VALUES_SCHEMA.read_text()
    assert committed == json.dumps(configschema.values_schema(json.loads(committed)),
                                   indent=2) + "\n", "run: make config-schema"


def test_the_readme_reference_is_the_generated_one() -> None:
    text = configschema.README.read_text()
    assert text == configschema.readme(text), "run: make config-schema"
    assert text.count(configschema.BEGIN) == 1 and text.count(configschema.END) == 1


def test_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{configschema.BEGIN}\n| old |\n{configschema.END}\n")
    monkeypatch.setattr(configschema, "README", readme)
    monkeypatch.setattr(configschema, "ROOT", tmp_path)
    monkeypatch.setattr(configschema, "VALUES_SCHEMA", tmp_path / "values.schema.json")
    configschema.VALUES_SCHEMA.write_text((ROOT / "helm/extproc/values.schema.json").read_text())
    assert configschema.main(["--check"]) == 1
    assert "README.md: out of date" in capsys.readouterr().err
    assert configschema.main([]) == 0 and configschema.main(["--check"]) == 0
    assert "| `pools[].name` | string | **required** |" in readme.read_text()


def test_the_example_and_the_chart_defaults_pass_both() -> None:
    example = yaml.safe_load((ROOT / "examples" / "extproc.yaml").read_text())
    assert problems(example) == []
    CHECK.validate(example)
    assert problems(CHART_CONFIG) == []
    jsonschema.Draft7Validator(configschema.chart_schema()).validate(CHART_CONFIG)
    jsonschema.Draft7Validator.check_schema(json.loads(configschema.VALUES_SCHEMA.read_text()))


def test_a_pool_needs_a_name_in_both() -> None:
    raw = {"pools": [{"models": ["*"]}]}
    assert problems(raw) == ["pools[0].name: required"]
    assert not CHECK.is_valid(raw)
    assert "name" in SCHEMA["properties"]["pools"]["items"]["required"]


# --- every key, both ways ------------------------------------------------------------------

# What a section needs around the key under test: a Redis ledger's keys need kind redis, a
# tenant key its source, a list item its required keys.
CONTEXT: dict[tuple[str | int, ...], dict[str, Any]] = {
    ("ledger",): {"kind": "redis", "url": "redis://h:6379"},
    ("pools", 0): {"name": "p"},
    ("routes", 0): {"path": "/p"},
    ("pools", 0, "engine_metrics"): {"targets": ["h:1"]},
    ("ledger", "sentinel"): {"addresses": ["h:1"], "service_name": "m"},
}
SOURCE_OF = {"metadata_namespace": "metadata", "metadata_key": "metadata", "claim": "metadata",
             "header": "header"}


def leaves(node: dict[str, Any], path: tuple[str | int, ...] = ()
           ) -> Iterator[tuple[tuple[str | int, ...], dict[str, Any]]]:
    for key, sub in node.get("properties", {}).items():
        here = (*path, key)
        yield here, sub
        if "properties" in sub:
            yield from leaves(sub, here)
        elif "properties" in sub.get("items", {}):
            yield from leaves(sub["items"], (*here, 0))
        elif "properties" in (sub.get("additionalProperties") or {}):
            yield from leaves(sub["additionalProperties"], (*here, "x1"))


def document(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """The smallest file that sets the key at ``path`` to ``value`` (set last, in its
    section, so that ``key_of`` finds it)."""
    # engine_metrics' default targets (from_capacity) need a source that discovers hosts
    root: dict[str, Any] = {"capacity": {"source": "envoy"}} if "engine_metrics" in path else {}
    node = root
    for i, part in enumerate(path[:-1]):
        if isinstance(path[i + 1], int):
            continue  # the list is made at its index
        around = dict(CONTEXT.get(path[:i + 1], {})) if path != ("ledger", "kind") else {}
        if path[:i + 1] == ("tenant",) and path[-1] in SOURCE_OF:
            around["source"] = SOURCE_OF[str(path[-1])]
        if isinstance(part, int):
            node[str(path[i - 1])] = [around]
        else:
            node[part] = around
        node = around
    node.pop(str(path[-1]), None)
    node[str(path[-1])] = value
    return root


BAD_BY_TYPE = {"integer": "seven", "number": "seven", "boolean": "yes", "string": 7}


def violations() -> Iterator[tuple[str, dict[str, Any]]]:
    """For every key with a type, bound or choice in the schema: a value it refuses."""
    for path, node in leaves(SCHEMA):
        kind = node.get("type")
        if kind in BAD_BY_TYPE:
            yield "type", document(path, BAD_BY_TYPE[kind])
        step = 1 if kind == "integer" else 0.5
        for keyword, past in (("minimum", -step), ("exclusiveMinimum", 0),
                              ("maximum", step), ("exclusiveMaximum", 0)):
            if keyword in node:
                yield keyword, document(path, node[keyword] + past)
        if "enum" in node:
            yield "enum", document(path, "no-such-choice")


def key_of(doc: dict[str, Any]) -> str:
    path: list[str | int] = []
    node: Any = doc
    while isinstance(node, dict | list):
        if isinstance(node, list):
            path.append(0)
            node = node[0]
            continue
        key = next(reversed(node))  # the key under test is set last
        path.append(key)
        node = node[key]
    return dotted(tuple(path))


CASES = list(violations())


@pytest.mark.parametrize(("why", "doc"), CASES, ids=[f"{key_of(d)}-{w}" for w, d in CASES])
def test_model_and_schema_refuse_the_same_bad_value(why: str, doc: dict[str, Any]) -> None:
    key = key_of(doc)
    found = problems(doc)
    assert any(line.startswith(f"{key}: ") for line in found), (doc, found)
    assert not CHECK.is_valid(doc), doc


# tls: its three files have no default, so its one default key is not tried alone
DEFAULTS = [(path, node["default"]) for path, node in leaves(SCHEMA)
            if "default" in node and path[0] != "tls"]


@pytest.mark.parametrize(("path", "default"), DEFAULTS, ids=[dotted(p) for p, _ in DEFAULTS])
def test_every_default_passes_both(path: tuple[str | int, ...], default: Any) -> None:
    doc = document(path, default)
    assert problems(doc) == [], doc
    CHECK.validate(doc)


def test_enough_keys_are_covered() -> None:
    """The walk reaches every section: a schema it cannot read would pass the tests above."""
    keys = {key_of(doc) for _, doc in CASES}
    assert len(CASES) > 150 and len(DEFAULTS) > 80
    for key in ("pools[0].engine.max_num_seqs", "classes.x1.safety_factor",
                "ledger.breaker.failures", "tenant.tenants.x1.weight",
                "pools[0].engine_metrics.min_coverage", "retry_after.max_s", "mode"):
        assert key in keys


def test_errors_never_quote_a_secret_or_an_unknown_keys_value() -> None:
    found = "\n".join(problems({"ledger": {
        "kind": "redis", "url": "redis:/hunter2", "pasword": "s3cret", "password": ["x1"]}}))
    assert "ledger.pasword: unknown key" in found
    assert "ledger.url: must be a redis://, rediss:// or unix:// URL (value not shown)" in found
    assert "ledger.password: must be a string (value not shown)" in found
    assert "hunter2" not in found and "s3cret" not in found and "x1" not in found
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"ledger": {"kind": "redis", "url": "redis:/hunter2"}})
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no pydantic text
