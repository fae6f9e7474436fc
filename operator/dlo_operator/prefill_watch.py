"""A prefill loader without progress, and the nodes a prefill Job left unfinished.

The Job alone waits for a hung loader until its deadline (the loader's timeouts, an hour and
more). `no_progress` finds the first prefill pod whose running loader has shown no progress for
`spec.loader.progressDeadlineSeconds` since the operator last saw it write bytes or change phase
on its metrics endpoint (`status.progress`'s `progressAt`, which `progress` keeps, also while the
endpoint stops answering); a loader whose endpoint never answered is not judged.
Its `Trouble` names the pod, the node and what the loader waits for (its phase). `unfinished`
names the nodes whose loader had not finished, for a Job that ran out of time. Pure; called by
`prefill_stage`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_contract.units import human_bytes
from dlo_operator.naming import LOADER_CONTAINER
from dlo_operator.pod_troubles import Trouble, TroubleReason
from dlo_operator.prefill_record import format_time, parse_time
from dlo_operator.spec import CR_LEAVES
from dlo_operator.status import LoaderState

DEADLINE_FIELD = next(f"spec.{leaf.meta.crd}" for leaf in CR_LEAVES
                      if leaf.path == "loader.progress_deadline_s")
WAITS_FOR = {
    "listing": "the source's listing of the model's objects",
    "waiting": "its node's cache lock or the other loaders of its group (the rendezvous)",
    "transferring": "bytes from the source or from its peers",
    "checking": "the check of the entry it wrote",
}
"""What a loader in each phase of `dlo_loader.metrics.PHASES` waits for."""


def no_progress(pods: Sequence[Mapping[str, Any]], progress: Mapping[str, Any],
                now: datetime.datetime, deadline_s: float) -> Trouble | None:
    """The first prefill pod (by name) whose running loader made no progress for
    `deadline_s`, or None."""
    shown = {row.get("pod"): row for row in progress.get("nodes") or ()}
    for pod in sorted(pods, key=_name):
        if "running" not in (_loader(pod).get("state") or {}):
            continue
        row = shown.get(_name(pod)) or {}
        since = parse_time(row.get("progressAt"))
        if since is None or now - since <= datetime.timedelta(seconds=deadline_s):
            continue  # no reading yet (or ever: the endpoint unreachable) tells nothing
        return Trouble(TroubleReason.NO_PROGRESS, _name(pod),
                       str((pod.get("spec") or {}).get("nodeName") or ""), LOADER_CONTAINER,
                       f"no progress since {format_time(since)} (more than "
                       f"{DEADLINE_FIELD}={deadline_s:g} s): {_waits_for(row)}")
    return None


def _waits_for(row: Mapping[str, Any]) -> str:
    phase = str(row.get("phase") or "")
    what = WAITS_FOR.get(phase, f"the end of its phase {phase or 'unknown'}")
    stalled = ", a read stalled" if row.get("stalled") else ""
    return (f"waiting for {what}{stalled} (phase {phase or 'unknown'}, "
            f"{human_bytes(int(row.get('bytesDone', 0)))} of "
            f"{human_bytes(int(row.get('bytesTotal', 0)))} written)")


def unfinished(nodes: Sequence[Mapping[str, Any]]) -> str:
    """The nodes whose prefill loader had not ended well, as a clause ("" when none)."""
    left = [f"{n.get('node') or 'an unscheduled node'} (pod {n.get('pod')}, loader "
            f"{n.get('loader')})" for n in nodes if n.get("loader") != LoaderState.CACHED.value]
    return f"not finished on {', '.join(left)}" if left else ""


def _loader(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or ()
                 if c.get("name") == LOADER_CONTAINER), {})


def _name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))
