"""The configuration's seam with pydantic: rules with the house's messages, and the translation
of pydantic's error list into the house's lines (``extproc.config`` uses both).

A line names the dotted key, says what it must be and quotes the bad value::

    pools[0].replicas: must be >= 0 (got -1)

Values of secret keys (``SECRET_KEYS``) are never quoted, and neither is the value of an unknown
key (a misspelt ``password`` is still a password).

Three ways a problem is found, all reported together where pydantic allows:

- a field's type or ``Rule`` (``within`` for bounds): per field, every field of a section;
- ``early(raw, handler, problems)``: problems seen in the raw mapping of a section (a key that
  belongs to another ``kind``), reported with the section's own field problems;
- ``fail(problems)`` from a model validator: cross-field problems, once the fields are valid.

``Section(model, build)`` lets a file write a plain object (the engine model, the autoscaling
policy) as a flat pydantic model's keys, checked and described by that model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import BaseModel, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError, core_schema

SECRET_KEYS = frozenset({"ledger.url", "ledger.password"})  # may hold a credential

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One bad key, relative to the section that found it. ``show``: quote ``value``."""

    loc: Loc
    why: str
    value: Any = None
    show: bool = True


def problem(why: str, show: bool = True) -> PydanticCustomError:
    """The error a rule raises: ``why`` as the line's message (braces in it are safe)."""
    return PydanticCustomError("extproc", "{why}", {"why": why, "show": show})


def fail(problems: Iterable[Problem]) -> NoReturn:
    """Raise every problem at once, each at its key below the section being validated."""
    raise ValidationError.from_exception_data("config", [
        InitErrorDetails(type=problem(p.why, p.show), loc=p.loc, input=p.value)
        for p in problems])


@dataclass(frozen=True, eq=False)  # hashed by identity: its schema is a dict
class Rule:
    """``Annotated[T, Rule(check, **schema)]``: ``check(value)`` returns None or why it is bad;
    ``schema`` holds the JSON Schema keywords that say the same (the Helm chart's schema)."""

    check: Callable[[Any], str | None]
    schema: Mapping[str, Any]
    quote: bool = True  # append the bad value (off where the message names it already)

    def __init__(self, check: Callable[[Any], str | None], *, quote: bool = True,
                 **schema: Any) -> None:
        object.__setattr__(self, "check", check)
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "quote", quote)

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), **self.schema}

    def _validate(self, value: Any) -> Any:
        if (why := self.check(value)) is not None:
            raise problem(why, self.quote)
        return value


@dataclass(frozen=True)
class Section:
    """``Annotated[T, Section(model, build)]``: a T that the file writes as ``model``'s keys
    (a flat pydantic model: the checks and the schema), built by ``build``. A T passes as is
    (``dataclasses.replace`` of an object holding one)."""

    model: type[BaseModel]
    build: Callable[[Any], Any]

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        def validate(value: Any) -> Any:
            if isinstance(value, source):
                return value
            return self.build(self.model.model_validate(value))

        return core_schema.no_info_plain_validator_function(validate)

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return self.model.model_json_schema()


def within(ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, why: str = "") -> Rule:
    """A bound on a number: the check, its message and its schema keywords from one place."""
    lo, hi = (ge if gt is None else gt), (le if lt is None else lt)
    if lo is not None and hi is not None:
        text = f"must be in {'[' if gt is None else '('}{lo:g}, {hi:g}{']' if lt is None else ')'}"
    elif lo is not None:
        text = f"must be {'>=' if gt is None else '>'} {lo:g}"
    else:
        text = f"must be {'<=' if lt is None else '<'} {hi:g}"
    text += f" ({why})" if why else ""

    def check(v: float) -> str | None:
        ok = ((ge is None or v >= ge) and (gt is None or v > gt)
              and (le is None or v <= le) and (lt is None or v < lt))
        return None if ok else text

    keywords: dict[str, Any] = {"minimum": ge, "exclusiveMinimum": gt, "maximum": le,
                                "exclusiveMaximum": lt}
    return Rule(check, **{k: v for k, v in keywords.items() if v is not None})


def early(raw: Any, handler: Callable[[Any], Any], problems: list[Problem],
          drop: Iterable[str] = ()) -> Any:
    """Validate ``raw`` after ``problems`` found in it beforehand, reporting all together: the
    keys in ``drop`` are left out, and a field problem at the same key yields to theirs."""
    if not problems:
        return handler(raw)
    named, dropped = {p.loc for p in problems}, set(drop)
    try:
        handler({k: v for k, v in raw.items() if k not in dropped})
    except ValidationError as exc:
        problems += [Problem(e["loc"], *_why(e)) for e in _errors(exc) if e["loc"] not in named]
    fail(problems)


def lines(exc: ValidationError) -> list[str]:
    """pydantic's errors as the house's lines, in the order found."""
    out = []
    for e in _errors(exc):
        key = dotted(e["loc"]) or "<root>"
        why, value, show = _why(e)
        got = "" if not show else (" (value not shown)" if key in SECRET_KEYS
                                   else f" (got {value!r})")
        out.append(f"{key}: {why}{got}")
    return out


def dotted(loc: Loc) -> str:
    """``("pools", 0, "replicas")`` -> ``pools[0].replicas``."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    return text.removeprefix(".")


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [dict(e) for e in exc.errors(include_url=False)]


_KINDS = {
    "int_type": "must be an integer", "int_from_float": "must be an integer",
    "int_parsing": "must be an integer", "float_type": "must be a number",
    "float_parsing": "must be a number", "bool_type": "must be true or false",
    "bool_parsing": "must be true or false", "string_type": "must be a string",
    "list_type": "must be a list", "tuple_type": "must be a list",
}
_MAPPINGS = {"dict_type", "dataclass_type", "dataclass_exact_type", "model_type",
             "model_attributes_type", "mapping_type"}


def _why(e: Mapping[str, Any]) -> tuple[str, Any, bool]:
    """(what the value must be, the value, whether to quote it) for one pydantic error."""
    kind, ctx, value = e["type"], e.get("ctx") or {}, e.get("input")
    if kind == "extproc":
        return ctx["why"], value, ctx["show"]
    if kind == "missing":
        return "required", value, False
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return "unknown key", value, False
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return "must be a number, not a boolean", value, True
    if kind in _KINDS:
        return _KINDS[kind], value, True
    if kind in _MAPPINGS:
        return f"must be a mapping, got {type(value).__name__}", value, False
    if kind in ("enum", "literal_error"):
        return f"must be one of {ctx['expected'].replace(' or ', ', ')}", value, True
    return str(e["msg"]), value, True
