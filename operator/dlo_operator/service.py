"""The two Services of a DOD.

`build_service`: the headless Service that gives each workload pod a stable DNS name.

The loaders rendezvous at pod 0's name (`<dod>-0.<dod>-peers.<ns>.svc`, completed by the pod's
DNS search domains, so no cluster domain is assumed) while they fill, i.e. before any pod is
Ready (a loader sidecar is ready once it published), so the Service publishes not-ready
addresses.

`build_inference_service`: a ClusterIP Service named like the DOD for `inference.ports`, so that
clients reach the Ready replicas at `<dod>.<namespace>` (only when ports are declared).
Pure; called by `manifests`.
"""

from __future__ import annotations

from typing import Any

from dlo_operator.naming import Owner, child_metadata, selector_labels
from dlo_operator.spec import DeploymentSpec


def build_service(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.service_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner),
            "ports": [{
                "name": "rendezvous",
                "port": spec.loader.port,
                "targetPort": spec.loader.port,
                "protocol": "TCP",
            }],
        },
    }


def build_inference_service(owner: Owner, spec: DeploymentSpec) -> dict[str, Any] | None:
    if not spec.inference.ports:
        return None
    ports = []
    for port in spec.inference.ports:
        number = port.get("containerPort")
        ports.append({
            "name": port.get("name") or f"port-{number}",
            "port": number,
            "targetPort": number,
            "protocol": port.get("protocol", "TCP"),
        })
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.inference_service_name),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner), "ports": ports},
    }
