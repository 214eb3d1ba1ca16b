"""What is generated from the models of ``extproc.config``, so that it cannot drift from them: the
``config`` section of the Helm chart's ``values.schema.json``, and the README's reference of
every key (type, default, bounds, description) between its marker comments.

    python -m extproc.config.schema           # rewrite both (make config-schema)
    python -m extproc.config.schema --check   # exit 1 naming what differs (tests do the same)

The schema is pydantic's ``model_json_schema`` made plain: references inlined (Helm's
validator reads one document, and the section sits below ``properties.config``), titles and
``null`` alternatives dropped (absent is how a file says "none"), object defaults dropped
(each key of a section shows its own). The chart then sets some keys itself (``CHART_SETS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from extproc.config import Config

ROOT = Path(__file__).resolve().parents[2]
VALUES_SCHEMA = ROOT / "helm" / "extproc" / "values.schema.json"
README = ROOT / "README.md"
BEGIN = ("<!-- config-reference: generated from extproc/config/ by `make config-schema`;"
         " tests/test_config_schema.py keeps it so -->")
END = "<!-- /config-reference -->"

_BY_REDIS = "set by the chart from redis.mode and redis.* (the template refuses it here)"
_BY_PORTS = ("set by the chart from extproc.transport/grpcPort/metricsPort (the template"
             " refuses it here)")
# Keys the chart writes into the sidecar's config itself (templates/_helpers.tpl,
# "extproc.config"): a description in their place, or left out where values set them elsewhere.
CHART_SETS: dict[tuple[str, ...], str | None] = {
    ("listen",): _BY_PORTS, ("metrics_listen",): _BY_PORTS,
    ("tracing",): None,  # tracing.*
    ("keda_listen",): None,  # autoscaling.mode keda
    **{("ledger", key): _BY_REDIS for key in
       ("kind", "url", "username", "password", "password_file", "password_env")},
}


def schema() -> dict[str, Any]:
    """The configuration file's JSON Schema (draft-07 keywords, one self-contained object)."""
    raw = TypeAdapter(Config).json_schema()
    plain: dict[str, Any] = _plain(raw, raw.get("$defs", {}))
    return plain


def _plain(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_plain(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        node = {**options[0], **node} if len(options) == 1 else {"anyOf": options, **node}
    if len(node.get("allOf", ())) == 1:
        node = {**node.pop("allOf")[0], **node}
    if "$ref" in node:
        node = {**defs[node.pop("$ref").rsplit("/", 1)[1]], **node}
    if node.get("default", 0) is None or isinstance(node.get("default"), dict) or (
            isinstance(node.get("default"), list) and any(
                isinstance(v, dict) for v in node["default"])):
        del node["default"]
    out = {k: ({name: _plain(p, defs) for name, p in v.items()} if k == "properties"
               else _plain(v, defs))  # property names are data, not keywords to drop
           for k, v in node.items() if k not in ("$defs", "title")}
    if isinstance(text := out.get("description"), str):
        out["description"] = " ".join(text.split())
    return out


def chart_schema() -> dict[str, Any]:
    """The ``config`` section of the chart's values: the file's schema less what the chart
    sets, with ``pools`` required (the chart names its pool for autoscaling.pool) and a
    pool's ``name`` left to the template (a nameless pools[0] is the chart's default pool)."""
    out = schema()
    for path, note in CHART_SETS.items():
        parent = out
        for key in path[:-1]:
            parent = parent["properties"][key]
        if note is None:
            del parent["properties"][path[-1]]
        else:
            parent["properties"][path[-1]] = {"description": note}
    out["properties"]["ledger"]["description"] = (
        "Tuning of the ledger; its connection (kind, url, username, password*) comes from"
        " redis.*.")
    # Helm replaces a list wholesale (`--set config.pools[0].replicas=3` leaves {replicas: 3}):
    # the template reads a nameless pools[0] as the chart's default pool and refuses a nameless
    # later entry, so the values schema leaves the name to it.
    pool = out["properties"]["pools"]["items"]
    pool["required"] = [key for key in pool["required"] if key != "name"]
    if not pool["required"]:
        del pool["required"]
    pool["properties"]["name"] = {
        **pool["properties"]["name"],
        "description": pool["properties"]["name"]["description"] + " In the chart: absent in"
        " pools[0] only, which is then the default pool (name default, models [\"*\"])."}
    return {"description": "extproc's configuration (extproc/config/)", **out,
            "required": ["pools"]}


def values_schema(current: dict[str, Any]) -> dict[str, Any]:
    """The chart's whole values schema with its ``config`` section generated."""
    return {**current, "properties": {**current["properties"], "config": chart_schema()}}


def reference() -> str:
    """The README's table: one row per key, sections first, then their keys."""
    rows = ["| Key | Type | Default | Bounds | Description |", "|---|---|---|---|---|"]
    _rows(schema(), "", rows)
    return "\n".join(rows)


def _rows(node: dict[str, Any], prefix: str, rows: list[str]) -> None:
    required = set(node.get("required", ()))
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        default = "**required**" if key in required else _default(sub)
        cells = [f"`{path}`", _type(sub), default, _bounds(sub), sub.get("description", "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if "properties" in sub:
            _rows(sub, f"{path}.", rows)
        elif "properties" in sub.get("items", {}):
            _rows(sub["items"], f"{path}[].", rows)
        elif "properties" in (sub.get("additionalProperties") or {}):
            _rows(sub["additionalProperties"], f"{path}.<name>.", rows)


def _type(node: dict[str, Any]) -> str:
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    if "const" in node:
        return f"`{node['const']}`"
    if "anyOf" in node:
        return " or ".join(_type(o) for o in node["anyOf"])
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object":
        values = node.get("additionalProperties")
        return f"map of {_type(values)}" if isinstance(values, dict) else "section"
    return str(kind)


def _default(node: dict[str, Any]) -> str:
    return f"`{json.dumps(node['default'])}`" if "default" in node else ""


_BOUNDS = {"minimum": ">= {}", "exclusiveMinimum": "> {}", "maximum": "<= {}",
           "exclusiveMaximum": "< {}", "minItems": "at least {} items",
           "maxItems": "at most {} items", "minLength": "at least {} characters",
           "maxLength": "at most {} characters", "pattern": "matches `{}`"}


def _bounds(node: dict[str, Any]) -> str:
    said = [text.format(node[k]) for k, text in _BOUNDS.items() if k in node]
    said += ["distinct"] if node.get("uniqueItems") else []
    said += [_bounds(o) for o in node.get("anyOf", ()) if _bounds(o)]
    return ", ".join(said)


def readme(text: str) -> str:
    """``text`` (the README) with the reference between the markers regenerated."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + reference() + "\n" + text[end:]


def _dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.config.schema",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a generated file is out of date")
    args = parser.parse_args(argv)
    current = VALUES_SCHEMA.read_text()
    readme_text = README.read_text()
    wanted = {VALUES_SCHEMA: _dump(values_schema(json.loads(current))),
              README: readme(readme_text)}
    stale = [path for path, text in wanted.items()
             if text != (current if path == VALUES_SCHEMA else readme_text)]
    for path in stale:
        if args.check:
            print(f"{path.relative_to(ROOT)}: out of date (make config-schema)",
                  file=sys.stderr)
        else:
            path.write_text(wanted[path])
            print(f"{path.relative_to(ROOT)}: regenerated")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
