"""The status fields of the rollout: the stage, the revision, the prefill record and the
`Prefilled` condition, from one `Decision`.

While old pods serve because a stage other than Serving holds the rollout (a prefill, its
backoff, the restart), `Ready` and `Progressing` name the stage. Pure; called by `reconcile`
after `status.status_from_pods`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlo_operator.conditions import FALSE, TRUE, Condition, merge_conditions
from dlo_operator.decision import Decision, Stage
from dlo_operator.naming import Owner, selector_labels
from dlo_operator.prefill_record import PrefillState
from dlo_operator.status import PREFILLED, PROGRESSING, READY, UPDATING

PREFILL_STUCK = "PrefillStuck"
"""The `Prefilled` reason (and Warning Event) of a prefill pod that cannot start its loader, or
whose loader shows no progress."""


def rollout_fields(owner: Owner, decision: Decision, status: Mapping[str, Any],
                   previous: Mapping[str, Any], now: str,
                   generation: int | None) -> dict[str, Any]:
    """The lifecycle fields: stage, revision, prefill record, `Prefilled` condition, selector
    (for the scale subresource). While old pods serve because a stage other than Serving holds
    the rollout (a prefill, its backoff, the restart), `Ready` and `Progressing` name the stage."""
    current = [prefilled(decision)]
    fields: dict[str, Any] = {
        "stage": decision.stage.value, "stageMessage": decision.message,
        "revision": decision.revision,
        "selector": ",".join(f"{k}={v}" for k, v in selector_labels(owner).items()),
    }
    if status["phase"] == UPDATING and decision.stage is not Stage.SERVING:
        fields["message"] = decision.message
        current += [Condition(kind, value, decision.stage.value, decision.message)
                    for kind, value in ((PROGRESSING, TRUE), (READY, FALSE))]
    stamped = {c["type"]: c for c in merge_conditions(  # `current` first, stamped
        previous.get("conditions"), current, generation=generation, now=now)[:len(current)]}
    fields["conditions"] = [stamped.pop(c["type"], c) for c in status["conditions"]] + list(
        stamped.values())
    fields["prefill"] = decision.prefill or None
    return fields


def prefilled(decision: Decision) -> Condition:
    prefill = decision.prefill
    state = prefill.get("state")
    if not prefill:
        return Condition(PREFILLED, TRUE, "NotNeeded", "no prefill has been needed")
    if decision.stuck is not None:
        return Condition(PREFILLED, FALSE, PREFILL_STUCK, decision.message)
    if state == PrefillState.FAILED.value:
        return Condition(PREFILLED, FALSE, "PrefillFailed", decision.message)
    if state == PrefillState.RUNNING.value:
        return Condition(PREFILLED, FALSE, "Prefilling", decision.message)
    if state == PrefillState.SUPERSEDED.value:
        return Condition(PREFILLED, TRUE, PrefillState.SUPERSEDED.value, str(prefill["message"]))
    return Condition(PREFILLED, TRUE, "PrefillSucceeded", str(prefill.get("message", "")))
