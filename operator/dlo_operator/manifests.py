"""All children of one DOD, in the order they are applied.

The ConfigMap and the headless Service come before the StatefulSet so that its pods never start
without their settings or their DNS names; the inference Service and the PodDisruptionBudget,
where the spec asks for them, follow. Pure; called by the handlers and by `dlo render`.
"""

from __future__ import annotations

from typing import Any

from dlo_operator.configmap import build_configmap
from dlo_operator.disruption_budget import build_disruption_budget
from dlo_operator.naming import Owner
from dlo_operator.service import build_inference_service, build_service
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import build_statefulset


def build_children(owner: Owner, spec: DeploymentSpec) -> list[dict[str, Any]]:
    optional = (build_inference_service(owner, spec), build_disruption_budget(owner, spec))
    return [
        build_configmap(owner, spec),
        build_service(owner, spec),
        build_statefulset(owner, spec),
        *(child for child in optional if child is not None),
    ]
