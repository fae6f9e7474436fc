"""What one step of the rollout sees and decides: the stages, `Observed` and `Decision`.

Data only: the reconciler fills `Observed` from the cluster, `rollout.decide` (with
`prefill_stage` for the Prefilling and Backoff stages) returns a `Decision`, and the reconciler
applies it. Must not compute anything itself.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlo_contract.fill_group import FillGroup
from dlo_operator.conditions import Report
from dlo_operator.pod_troubles import Trouble


class Stage(str, enum.Enum):
    CREATING = "Creating"
    SERVING = "Serving"
    RESTARTING = "Restarting"
    PREFILLING = "Prefilling"
    BACKOFF = "Backoff"


@dataclass(frozen=True, kw_only=True)
class Observed:
    statefulset: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    """Workload pods of the DOD (deleting ones included)."""
    group: FillGroup | None
    """The published fill-group document; None when its ConfigMap is missing."""
    jobs: Sequence[Mapping[str, Any]]
    job_pods: Sequence[Mapping[str, Any]]
    settings_configmaps: Sequence[Mapping[str, Any]]
    prefill: Mapping[str, Any]
    """The previous `status.prefill` record ({} when none)."""
    now: datetime.datetime
    progress: Mapping[str, Any] = field(default_factory=dict)
    """The previous `status.progress` (the loaders' live progress, `progressAt` per pod)."""
    refused: Mapping[str, Trouble] = field(default_factory=dict)
    """A pod the API server refused to create, by the name of the StatefulSet or prefill Job
    that tried (`pod_refusals`)."""
    optional: Sequence[tuple[str, str]] = ()
    """(kind, name) of the optional children (`manifests.optional_child_names`) that exist and
    this DOD owns."""


@dataclass(kw_only=True)
class Decision:
    stage: Stage
    message: str
    revision: str = ""
    """The revision the spec asks for."""
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of children to delete."""
    prefill: dict[str, Any] = field(default_factory=dict)
    reports: list[Report] = field(default_factory=list)
    stuck: Trouble | None = None
    """A prefill pod that cannot start its loader (not schedulable, image not pulled, ...): the
    prefill waits on it until someone acts, and `Prefilled` says so."""
