"""What the API server does with the CRD's schema, for the tests: defaulting, strict field
validation, the schema and CEL evaluation (with cel-python), so the tests can judge a CR as
`kubectl apply` would. The model itself is `dlo_operator.crd_verdict`, which `dlo render` and the
operator also run; this module adds the test-side views of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo_operator import crd_verdict
from dlo_operator.crd_verdict import (  # noqa: F401  (re-exported for the tests)
    CelRule,
    apply_defaults,
    crd_refusals,
    root_schema,
    to_cel,
    unknown_fields,
)

ROOT = Path(__file__).parents[2]
CRD_PATH = ROOT / "crds" / crd_verdict.CRD_FILE
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_crd() -> dict[str, Any]:
    return crd_verdict.load_crd()


def cel_rules(crd: dict[str, Any] | None = None, where: str = ".spec") -> list[CelRule]:
    """The CEL rules on one object of the schema (the spec's by default)."""
    return [rule for rule in crd_verdict.cel_rules() if rule.where == where]
