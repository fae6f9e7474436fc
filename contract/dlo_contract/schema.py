"""How a setting is declared: one `setting(...)` per field carries everything generated from it.

A field of a settings model (`dlo_contract.settings`) or of the CR-only deployment model
(`dlo_contract.deployment`) is declared once, with its default, its description (meaning, unit,
why the default), its bounds, the camelCase path the user writes in a `DiffusionOffloadDeployment`
spec (`crd`), and the loader flag that overrides it (`cli`). From that declaration come the CRD's
`openAPIV3Schema` (`dlo_contract.crd`), the README reference, the loader's argparse flags, the
bound checks of `dlo_contract.validation` and the CR-to-document mapping of the operator.

Types are checked when a model is built (pydantic: strict, frozen, unknown fields refused); bounds
are checked by `validation.validate`, so one call reports every problem of a document at once.
Torch-free.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from dlo_contract.errors import PermanentError


class SettingsError(PermanentError):
    """The settings document cannot be parsed, or names a value that is not allowed."""


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """Single-field bounds; the CRD states them as `minimum`/`enum`/`pattern`, `validate` checks
    them. `above` is an exclusive minimum (`must be greater than`)."""

    above: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    one_of: tuple[Any, ...] | None = None
    min_length: int | None = None
    max_items: int | None = None
    pattern: str | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` is out of bounds, or None."""
        if self.above is not None and value <= self.above:
            return f"must be greater than {self.above:g}"
        if self.minimum is not None and value < self.minimum:
            return f"must be {self.minimum:g} or more"
        if self.maximum is not None and value > self.maximum:
            return f"must be {self.maximum:g} or less"
        if self.one_of is not None and value not in self.one_of:
            *first, last = [str(v) for v in self.one_of]
            return f"must be {', '.join(first)} or {last}" if first else f"must be {last}"
        if self.min_length is not None and len(value) < self.min_length:
            return "must not be empty" if self.min_length == 1 else \
                f"must have at least {self.min_length} characters"
        if self.max_items is not None and len(value) > self.max_items:
            return f"must have at most {self.max_items} items"
        if self.pattern is not None:
            if not re.search(self.pattern, value):
                return f"must match {self.pattern}"
        return None


@dataclass(frozen=True, kw_only=True)
class Meta:
    """What `setting()` records beside the default and the description."""

    crd: str | None
    """Path under the CR's `spec` (camelCase), or None for a field the CR does not carry."""
    cli: str | None = None
    """The `dlo cache fill` flag that overrides the field, or None."""
    bounds: Bounds = Bounds()
    required: bool = False
    """The CR must set it (the CRD lists it under `required`)."""
    empty_is_none: bool = False
    """An optional string: the CRD defaults it to "" (a structural schema has no null default)
    and the document holds None."""
    int64: bool = False
    """Integer that may exceed 2^31 (the CRD says `format: int64`)."""


def setting(default: Any = ..., *, description: str, crd: str | None, cli: str | None = None,
            required: bool = False, int64: bool = False, **bounds: Any) -> Any:
    """Declare one field: `default` (a callable for mutable defaults), `description`, `crd` path,
    `cli` flag and bounds (`above`, `minimum`, `maximum`, `one_of`, `min_length`, `max_items`,
    `pattern`)."""
    optional_string = default is None and crd is not None
    meta = Meta(crd=crd, cli=cli, bounds=Bounds(**bounds), required=required,
                empty_is_none=optional_string, int64=int64)
    extra = {"dlo": meta}
    if callable(default):
        return Field(default_factory=default, description=description, json_schema_extra=extra)
    return Field(default, description=description, json_schema_extra=extra)


def meta_of(info: FieldInfo) -> Meta | None:
    extra = info.json_schema_extra
    return extra.get("dlo") if isinstance(extra, dict) else None  # type: ignore[return-value]


class Section(BaseModel):
    """Base of every settings model: frozen, strict types, unknown fields refused. Parse
    documents with `from_dict`, whose `SettingsError` names the field path."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def to_dict(self) -> dict[str, Any]:
        return plain(self)


def plain(value: Any) -> Any:
    """JSON-ready copy of a model (tuples become lists)."""
    if isinstance(value, BaseModel):
        return {name: plain(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Leaf:
    """One declared field of a model tree, by its document path."""

    path: str
    name: str
    annotation: Any
    info: FieldInfo
    meta: Meta


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[Leaf]:
    """Every declared field under `model`, depth first, in declaration order."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from leaves(annotation, f"{path}.")
            continue
        meta = meta_of(info)
        if meta is not None:
            yield Leaf(path, name, annotation, info, meta)


def default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def base_type(annotation: Any) -> Any:
    """`str | None` -> str; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation


def type_name(annotation: Any) -> str:
    annotation = base_type(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if origin is tuple:
        return "a list of strings"
    if origin is dict:
        return "an object"
    return getattr(annotation, "__name__", str(annotation))


def _field_at(model: type[BaseModel], loc: tuple[Any, ...]) -> FieldInfo | None:
    info = None
    for part in loc:
        if not isinstance(part, str) or part not in model.model_fields:
            return info if info is not None and not isinstance(part, str) else None
        info = model.model_fields[part]
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            model = info.annotation
    return info


def describe(exc: ValidationError, model: type[BaseModel], root: str,
             name: Callable[[str], str] | None = None) -> str:
    """One line per pydantic error: `<path>: expected <type>, found <type> <value>`, with the
    allowed names for an unknown field. `name` turns a dotted document path into the name shown
    (default `<root>.<path>`)."""
    name = name or (lambda path: f"{root}.{path}" if path else root)
    lines = []
    unknown: dict[tuple[Any, ...], list[str]] = {}
    for error in exc.errors():
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
            continue
        where = name(".".join(str(p) for p in loc if isinstance(p, str)))
        value = error.get("input")
        info = _field_at(model, loc)
        if error["type"] in ("literal_error", "enum"):
            allowed = typing.get_args(base_type(info.annotation)) if info else ()
            lines.append(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        elif error["type"] in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{where}: expected an object, found {type(value).__name__}")
        else:
            expected = type_name(info.annotation) if info else "another type"
            lines.append(f"{where}: expected {expected}, found {type(value).__name__} {value!r}")
    for loc, names in unknown.items():
        section: type[BaseModel] = model
        for part in loc:
            annotation = section.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                section = annotation
        allowed = ", ".join(sorted(section.model_fields))
        lines.append(f"{name('.'.join(map(str, loc)))}: unknown field(s) "
                     f"{', '.join(sorted(names))}; allowed: {allowed}")
    return "; ".join(lines)
