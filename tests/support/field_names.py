"""The check behind the field-name walks: a message names every settings field the way the
document's origin spells it, and no field another way.

A document written by hand is named by its document paths (`loader.memory_limit_bytes`); one the
operator rendered from a CR (`Settings.origin` set) by the CR paths the user wrote
(`spec.loader.memoryLimitBytes`). The spellings come from the schema's declarations, not from
the namer under test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlo_contract.schema import leaves
from dlo_contract.settings import Settings

CR_ORIGIN = "DiffusionOffloadDeployment default/flux"
ORIGINS = (None, CR_ORIGIN)
"""A document written by hand, and one the operator rendered from a CR."""

_SPELLINGS = {leaf.path: leaf.meta.crd for leaf in leaves(Settings) if leaf.meta.crd}


def spelled(path: str, origin: str | None) -> str:
    """How the user wrote the field at document path `path`."""
    return f"spec.{_SPELLINGS[path]}" if origin else path


def misnamed(text: str, origin: str | None) -> list[str]:
    """Every dotted field name in `text` spelled otherwise than `origin` calls for."""
    found = []
    for path, crd in _SPELLINGS.items():
        if "." not in path:
            continue  # `quantization` is also an English word
        right = spelled(path, origin)
        for wrong in {path, crd, f"spec.{path}", f"spec.{crd}"} - {right}:
            if re.search(rf"(?<![\w.]){re.escape(wrong)}(?![\w])", text):
                found.append(wrong)
    return sorted(found)


@dataclass(frozen=True)
class Case:
    """One message a plane writes about `fields` (document paths): `drive(env, origin)` makes
    the plane write it for a document of that origin (`env`: what the plane's test module sets
    up, a store or a directory) and returns the whole text (message and hint)."""

    id: str
    fields: tuple[str, ...]
    drive: Callable[[Any, str | None], str]


def text_of(exc: BaseException) -> str:
    hint = getattr(exc, "hint", None)
    return f"{exc} (hint: {hint})" if hint else str(exc)


def check(case: Case, env: Any, origin: str | None) -> None:
    """Drive `case` for `origin`; its text names each of its fields as `origin` spells it."""
    text = case.drive(env, origin)
    for path in case.fields:
        assert re.search(rf"(?<![\w.]){re.escape(spelled(path, origin))}(?![\w])", text), (
            f"{case.id}: {spelled(path, origin)} not in {text!r}")
    assert misnamed(text, origin) == [], f"{case.id}: {text!r}"
