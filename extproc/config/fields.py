"""The kinds of value a configuration key holds, each strict (no silent conversions: "5" is
not a number, 1 is not true; ints are numbers) and with its bounds and message
(``extproc.config.rules``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Strict, WithJsonSchema

from extproc.config.rules import Rule, problem, within
from extproc.decision.share import LEVELS, MAX_LEVEL, parse_priority

# Every section: unknown keys are errors; a key with an alias (routes' ``class``) is read by
# the alias alone, as the schema says; each attribute's docstring is its description.
MODEL = ConfigDict(extra="forbid", validate_by_alias=True, validate_by_name=False,
                   use_attribute_docstrings=True)

Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Positive = Annotated[Num, within(gt=0)]
NonNegative = Annotated[Num, within(ge=0)]
Fraction = Annotated[Num, within(gt=0, le=1)]
Count = Annotated[Int, within(ge=0)]
Named = Annotated[Text, Rule(lambda v: None if v else "must not be empty", minLength=1)]
File = Annotated[Text, Rule(lambda v: None if Path(v).is_file() else "no such file")]


def _address(v: str) -> str | None:
    if v.startswith("unix:"):
        return None
    host, sep, port = v.rpartition(":")
    if not (sep and host and port.isdigit()):
        return "must be HOST:PORT or unix:PATH"
    # 0: any free port (what tests bind); above 65535 no socket exists, and Envoy's config
    # rendered from this one would name it
    return None if int(port) <= 65535 else "the port must be 0-65535"


def _header(v: str) -> str | None:
    # Lower-case (Envoy sends names lower-cased) and no underscore: Envoy drops headers
    # with underscores when tenant attribution is on (extproc.gateway.envoyconf).
    if v and all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in v):
        return None
    return "must be a lower-case header name of letters, digits and '-'"


def _level(value: Any) -> Any:
    if (level := parse_priority(value)) is None:
        raise problem(f"must be critical, standard, sheddable or a whole number in"
                      f" [-{MAX_LEVEL}, {MAX_LEVEL}]")
    return level


Address = Annotated[Text, Rule(_address)]
Header = Annotated[Text, Rule(_header, pattern="^[a-z0-9-]+$")]
Level = Annotated[int, BeforeValidator(_level), WithJsonSchema({"anyOf": [
    {"type": "string", "enum": sorted(LEVELS)},
    {"type": "integer", "minimum": -MAX_LEVEL, "maximum": MAX_LEVEL}]})]


