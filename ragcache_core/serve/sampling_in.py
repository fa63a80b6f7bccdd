"""The wire models of the sampling settings, derived from `SamplingConfig` (the one declaration
of the sampling fields, `config.py`) rather than written out a second time:

    SamplingIn             `/v1/rag/query`'s `sampling`: every `SamplingConfig` field, each
                           optional (null or left out: the server's `CacheConfig.sampling`)
    StructuredOutputsIn    `StructuredOutputs`, with its defaults (also the OpenAI routes'
                           `structured_outputs`)
    RepetitionDetectionIn  `RepetitionDetection`, with its defaults (also the OpenAI routes'
                           `repetition_detection`)
    OpenAISamplingIn       the sampling fields of `/v1/chat/completions` and `/v1/completions`
                           (the base of their bodies, `serve/schemas.py`): every
                           `SamplingConfig` field but those the routes own (`ROUTE_FIELDS`),
                           with the types and defaults of vLLM's request models

A field's wire type follows from its Python type: a tuple is a JSON list, a mapping a JSON
object (its keys strings), text pydantic's `StrictStr` (unless the field's metadata says
`lax_str`), a nested dataclass its own model; bounds come from the field's metadata (`ge`,
`le`). On the OpenAI routes a field is null by default where `SamplingConfig`'s default is
None or empty, or where null means the model's generation config (`generation_config`);
else it has `SamplingConfig`'s default; `stop` and `bad_words` take vLLM's own shapes
(`_OPENAI_SHAPES`). tests/data/serve_schemas.json pins the resulting JSON schemas
(test_serve_schemas.py).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model

from ragcache_core.config import RepetitionDetection, SamplingConfig, StructuredOutputs


class _DerivedIn(BaseModel):
    """A wire model of a frozen dataclass (`SOURCE`): `given()` is its fields as the dataclass
    takes them (lists as tuples, nested models as their dataclasses)."""

    model_config = ConfigDict(extra="forbid")
    SOURCE: ClassVar[Any] = None
    NAMES: ClassVar[dict[str, str]] = {}
    """The dataclass's field name of each attribute (`json_` is `json`: `BaseModel.json`)."""

    def given(self, *, skip_none: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for attr, name in type(self).NAMES.items():
            value = getattr(self, attr)
            if value is None and skip_none:
                continue
            out[name] = config_value(value)
        return out

    def value(self, name: str) -> Any:
        """The field `name` (the dataclass's name) as the dataclass takes it."""
        attr = {n: a for a, n in type(self).NAMES.items()}[name]  # KeyError: not a field
        return config_value(getattr(self, attr))

    def to_config(self) -> Any:
        """The dataclass (its own checks raise `SamplingError` naming the field)."""
        return type(self).SOURCE(**self.given(skip_none=False))


def config_value(value: Any) -> Any:
    """A wire value as the dataclasses take it: a list as a tuple, a nested model as its
    dataclass (whose checks raise `SamplingError`)."""
    if isinstance(value, _DerivedIn):
        return value.to_config()
    return tuple(value) if isinstance(value, list) else value


class _SamplingBase(_DerivedIn):
    def over(self, default: SamplingConfig) -> SamplingConfig:
        """`default` with the given fields (`SamplingError` naming one out of range)."""
        return dataclasses.replace(default, **self.given(skip_none=True))


MAX_STOP_STRINGS = 4
"""vLLM's `VLLM_MAX_STOP_STRINGS` default: at most 4 stop strings per request."""
ROUTE_FIELDS = ("max_tokens", "logprobs")
"""`SamplingConfig` fields the OpenAI routes own: `max_tokens` is clamped to the context by the
server, `logprobs` is a flag on chat (with `top_logprobs`) and a count on completions."""
_OPENAI_SHAPES: dict[str, tuple[Any, Any]] = {
    # One string or a list, as vLLM takes it, of at most vLLM's VLLM_MAX_STOP_STRINGS.
    "stop": (
        StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None,
        None,
    ),
    # vLLM's models take no null here (an empty list by default).
    "bad_words": (list[StrictStr], Field(default_factory=list)),
}


class _OpenAISampling(_DerivedIn):
    """The OpenAI routes' sampling fields; `given` reads a lone `stop` string as one stop."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def given(self, *, skip_none: bool) -> dict[str, Any]:
        out = super().given(skip_none=skip_none)
        if isinstance(out.get("stop"), str):
            out["stop"] = (out["stop"],)
        return out


def _wire_type(hint: Any, meta: Mapping[str, Any], nested: Mapping[type, type]) -> Any:
    """The pydantic type of a dataclass field of type `hint` (see the module docstring)."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return hint
    if origin in (Union, types.UnionType):
        members: list[Any] = []
        for arg in typing.get_args(hint):
            wire = _wire_type(arg, meta, nested)
            if wire not in members:
                members.append(wire)
        return functools.reduce(operator.or_, members)
    if origin is tuple:
        return list[_wire_type(typing.get_args(hint)[0], meta, nested)]  # type: ignore[misc]
    if origin is Mapping:
        return dict[str, typing.get_args(hint)[1]]  # type: ignore[misc]
    if hint is str:
        return str if meta.get("lax_str") else StrictStr
    if hint in nested:
        return nested[hint]
    if dataclasses.is_dataclass(hint):
        raise TypeError(f"no wire model given for {hint!r} (pass it in `nested`)")
    bounds = {key: meta[key] for key in ("ge", "le") if key in meta}
    return Annotated[hint, Field(**bounds)] if bounds else hint


Shape = Callable[[dataclasses.Field[Any], Any], tuple[Any, Any]]
"""(a dataclass field, its wire type) -> (the model's annotation, its default)."""


def _as_declared(f: dataclasses.Field[Any], wire: Any) -> tuple[Any, Any]:
    """The dataclass's own default."""
    return wire, f.default


def _optional(f: dataclasses.Field[Any], wire: Any) -> tuple[Any, Any]:
    """Each also null, None by default (left out: the server's `CacheConfig.sampling`)."""
    return wire | None, None


def _openai(f: dataclasses.Field[Any], wire: Any) -> tuple[Any, Any]:
    """vLLM's request models (the module docstring)."""
    if f.name in _OPENAI_SHAPES:
        return _OPENAI_SHAPES[f.name]
    if f.default is None or f.default == () or f.metadata.get("generation_config"):
        return wire | None, None
    return wire, f.default


def _derive(
    name: str,
    source: type,
    base: type[_DerivedIn],
    doc: str | None,
    *,
    shape: Shape,
    nested: Mapping[type, type] = {},
    skip: tuple[str, ...] = (),
) -> type[_DerivedIn]:
    """`source`'s wire model `name`: its fields in order (but `skip`), each of its wire type,
    annotated and defaulted by `shape`."""
    hints = typing.get_type_hints(source)
    definitions: dict[str, Any] = {}
    names: dict[str, str] = {}
    for f in dataclasses.fields(source):
        if f.name in skip:
            continue
        wire, default = shape(f, _wire_type(hints[f.name], f.metadata, nested))
        attr = f"{f.name}_" if hasattr(BaseModel, f.name) else f.name
        names[attr] = f.name
        value = Field(default=default, alias=f.name) if attr != f.name else default
        definitions[attr] = (wire, value)
    model = create_model(  # type: ignore[call-overload]
        name, __base__=base, __doc__=doc, __module__=__name__, **definitions
    )
    model.SOURCE = source
    model.NAMES = names
    return typing.cast(type[_DerivedIn], model)


if TYPE_CHECKING:
    StructuredOutputsIn = _DerivedIn
    RepetitionDetectionIn = _DerivedIn
    SamplingIn = _SamplingBase
    OpenAISamplingIn = _OpenAISampling
else:
    StructuredOutputsIn = _derive(
        "StructuredOutputsIn",
        StructuredOutputs,
        _DerivedIn,
        "vLLM's `structured_outputs` (`StructuredOutputsParams`).",
        shape=_as_declared,
    )
    RepetitionDetectionIn = _derive(
        "RepetitionDetectionIn", RepetitionDetection, _DerivedIn, None, shape=_as_declared
    )
    _NESTED = {
        StructuredOutputs: StructuredOutputsIn,
        RepetitionDetection: RepetitionDetectionIn,
    }
    SamplingIn = _derive(
        "SamplingIn",
        SamplingConfig,
        _SamplingBase,
        "`SamplingConfig`, field for field; those left out take the server's\n"
        "    `CacheConfig.sampling`. Ranges are `SamplingConfig`'s (vLLM's).",
        shape=_optional,
        nested=_NESTED,
    )
    OpenAISamplingIn = _derive(
        "OpenAISamplingIn",
        SamplingConfig,
        _OpenAISampling,
        _OpenAISampling.__doc__,
        shape=_openai,
        nested=_NESTED,
        skip=ROUTE_FIELDS,
    )
