"""`build_disruption_budget`: the optional PodDisruptionBudget over a DOD's pods.

A node drain evicts serving pods one budget at a time instead of all at once; each evicted pod
comes back on another node and refills its cache there. Off by default (a budget can block a
drain of a one-replica DOD for good). Pure; called by `manifests`.
"""

from __future__ import annotations

from typing import Any

from dlo_operator.naming import Owner, child_metadata, selector_labels
from dlo_operator.spec import DeploymentSpec


def build_disruption_budget(owner: Owner, spec: DeploymentSpec) -> dict[str, Any] | None:
    if not spec.disruption_budget.enabled:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, owner.disruption_budget_name),
        "spec": {
            "maxUnavailable": _count_or_percent(spec.disruption_budget.max_unavailable),
            "selector": {"matchLabels": selector_labels(owner)},
        },
    }


def _count_or_percent(value: str) -> int | str:
    """The API's int-or-string: "25%" stays a string, "1" becomes the count 1 (a string that is
    not a percentage is refused)."""
    return int(value) if value.isdigit() else value
