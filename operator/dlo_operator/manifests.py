"""All children of one DOD at one revision, in the order they are applied on create.

The settings ConfigMap, the fill-group document and the Service come before the StatefulSet so
that its pods never start without their settings, their group or their DNS names. On create the
group holds every pod: the first fill is one cooperative group. The inference Service, the
PodDisruptionBudget and the NetworkPolicy, where the spec and the platform ask for them,
follow. The fill Secret closes `build_children` without its data: the reconciler creates it
before any other child, once, with random data (`fill_secret`), so a render never shows it. `drifted` compares a manifest with
its live object as the reconciler applies it. Pure; called by `rollout`,
`prefill_stage`, `reconcile` (the names of the optional children it looks for) and `dlo render`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlo_contract.fill_group import FillGroup
from dlo_operator.configmap import build_configmap, build_fill_group_configmap, revision
from dlo_operator.disruption_budget import build_disruption_budget
from dlo_operator.fill_secret import build_fill_secret
from dlo_operator.naming import Owner
from dlo_operator.network_policy import build_network_policy
from dlo_operator.service import build_inference_service, build_service
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import build_statefulset


def fill_group(owner: Owner, spec: DeploymentSpec, ordinals: range) -> FillGroup:
    """The group of the workload pods `ordinals` (a create or a scale-up)."""
    if len(ordinals) < 2:
        return FillGroup()
    return FillGroup(
        revision=revision(spec),
        members={owner.pod_name(o): rank for rank, o in enumerate(ordinals)},
        master_addr=owner.pod_address(owner.pod_name(ordinals[0]), owner.service_name),
        master_port=spec.loader.port)


def restart_children(owner: Owner, spec: DeploymentSpec, live: int) -> list[dict[str, Any]]:
    """The children that roll the pods into the spec's revision. No fill group: each restarted
    pod finds its entry cached (prefilled, or unchanged) or fills alone. The StatefulSet keeps
    its `live` replicas, or fewer (a scale-down never waits): a scale-up follows once the new
    template is applied, so that its new pods fill as one group (`rollout` opens it)."""
    return [build_configmap(owner, spec), build_fill_group_configmap(owner, FillGroup()),
            build_service(owner, spec), build_statefulset(owner, spec, min(live, spec.replicas))]


def optional_children(owner: Owner, spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The inference Service, the PodDisruptionBudget and the NetworkPolicy, where the spec (or
    the platform) asks for them; they never restart a pod, so every stage of a rollout applies
    them as asked (and deletes the ones turned off, `optional_child_names`)."""
    optional = (build_inference_service(owner, spec), build_disruption_budget(owner, spec),
                build_network_policy(owner, spec))
    return [child for child in optional if child is not None]


def optional_child_names(owner: Owner) -> tuple[tuple[str, str], ...]:
    """(kind, name) of each child `optional_children` may build, on or off."""
    return (("Service", owner.inference_service_name),
            ("PodDisruptionBudget", owner.disruption_budget_name),
            ("NetworkPolicy", owner.network_policy_name))


def build_children(owner: Owner, spec: DeploymentSpec) -> list[dict[str, Any]]:
    return [
        build_configmap(owner, spec),
        build_fill_group_configmap(owner, fill_group(owner, spec, range(spec.replicas))),
        build_service(owner, spec),
        build_statefulset(owner, spec),
        *optional_children(owner, spec),
        build_fill_secret(owner),
    ]


def drifted(desired: Any, live: Any) -> bool:
    """True when a field `desired` sets differs in `live`. Fields only `live` has (defaults,
    other controllers' fields, status) are not drift."""
    if isinstance(desired, Mapping):
        return not isinstance(live, Mapping) or any(
            drifted(value, live.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        return not isinstance(live, list) or len(desired) != len(live) or any(
            drifted(d, v) for d, v in zip(desired, live))
    return desired != live
