"""The prefill of a new cache entry: an Indexed Job pinned to the serving nodes, plus the headless
Service its loaders rendezvous through.

A change of the entry key (a new model) is filled on every node that serves the DOD before any
pod restarts: one Job of N pods, one per serving node (required node affinity on the nodes'
names, required anti-affinity between the Job's pods), each a `dlo cache fill` of rank
`job-completion-index` in a group of N, rendezvous at pod 0's stable name under the prefill
Service. The Job carries its own fill group in its environment: it is one fill, so its size is
fixed when the operator creates it. Any pod's failure fails the Job (`backoffLimit: 0`, the
loaders fail together anyway); the operator reports it and retries with backoff. Pure; called by
`prefill_stage`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_contract.names import MASTER_ADDR_ENV, MASTER_PORT_ENV, RANK_ENV, WORLD_SIZE_ENV
from dlo_operator.configmap import revision
from dlo_operator.naming import (
    LABEL_DEPLOYMENT,
    LABEL_JOB_INDEX,
    LABEL_REVISION,
    LABEL_ROLE,
    PREFILL_ROLE,
    Owner,
    child_metadata,
)
from dlo_operator.pod import loader_container, volumes
from dlo_operator.spec import DeploymentSpec

_DEADLINE_MARGIN_S = 300
"""Beyond the loader's own timeouts: image pulls and scheduling of the Job's pods."""


def prefill_labels(owner: Owner, rev: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: owner.name, LABEL_ROLE: PREFILL_ROLE, LABEL_REVISION: rev}


def build_prefill_service(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.prefill_service_name,
                                   **{LABEL_ROLE: PREFILL_ROLE}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_DEPLOYMENT: owner.name, LABEL_ROLE: PREFILL_ROLE},
            "ports": [{"name": "rendezvous", "port": spec.loader.port,
                       "targetPort": spec.loader.port, "protocol": "TCP"}],
        },
    }


def build_prefill_job(owner: Owner, spec: DeploymentSpec,
                      nodes: Sequence[str]) -> dict[str, Any]:
    """One loader per node in `nodes`, filling the entry of `spec` together."""
    rev = revision(spec)
    world = len(nodes)
    group_env = [
        {"name": RANK_ENV, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{LABEL_JOB_INDEX}']"}}},
        {"name": WORLD_SIZE_ENV, "value": str(world)},
        {"name": MASTER_ADDR_ENV, "value": owner.prefill_master_addr(rev)},
        {"name": MASTER_PORT_ENV, "value": str(spec.loader.port)},
    ]
    labels = prefill_labels(owner, rev)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": owner.prefill_service_name,
        "automountServiceAccountToken": spec.automount_service_account_token,
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{
                    "key": "metadata.name", "operator": "In", "values": sorted(nodes)}]}]}},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": labels},
                "topologyKey": "kubernetes.io/hostname"}]},
        },
        "containers": [loader_container(spec, group_env)],
        "volumes": volumes(owner, owner.settings_name(rev), spec),
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.tolerations:
        pod_spec["tolerations"] = [copy.deepcopy(dict(t)) for t in spec.tolerations]
    if spec.image_pull_secrets:  # the loader image may live in the same private registry
        pod_spec["imagePullSecrets"] = [copy.deepcopy(dict(s)) for s in spec.image_pull_secrets]
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    loader = spec.settings.loader
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": child_metadata(owner, owner.prefill_name(rev), **labels),
        "spec": {
            "completionMode": "Indexed",
            "completions": world,
            "parallelism": world,
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(loader.timeout_s + loader.rendezvous_timeout_s
                                         + _DEADLINE_MARGIN_S),
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def pinned_nodes(job: Mapping[str, Any]) -> list[str]:
    """The nodes a prefill Job's pods are pinned to (the node affinity `build_prefill_job` set)."""
    try:
        terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    except (KeyError, TypeError):
        return []
    return sorted({node for term in terms for match in term.get("matchFields") or ()
                   for node in match.get("values") or ()})
