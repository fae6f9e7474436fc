"""The node-cache provisioner: one PersistentVolume per node-cache claim, deleted after the claim.

The operator is the provisioner of the StorageClass `node_cache.NODE_CACHE_CLASS` (see [Note: the
node cache's tenant boundary] in `node_cache`). `serve_claim` answers a claim whose node the
scheduler chose with the volume of its namespace's directory on that node, pre-bound to that
claim (the PersistentVolume controller then binds them, and the kubelet mounts it). A volume
whose claim is gone (`release_claim` on the claim's deletion; `reclaim_volume` for any volume
event, which covers claims deleted while the operator was down) is deleted: the object only, the
cached bytes stay on the node for the namespace's next pod. Every step is idempotent (a volume's
name holds its claim's uid), so a repeated or late event changes nothing.

Called by the kopf handlers in `handlers`; talks to the cluster only through `kube`. It must not
choose a node directory from anything but the claim's namespace and `NodeCacheConfig.root`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from dlo_operator.errors import KubeTransientError
from dlo_operator.kube import KubeClient, backoff_delay
from dlo_operator.node_cache import (
    HOSTNAME_LABEL,
    NODE_CACHE_CLASS,
    NodeCacheConfig,
    build_persistent_volume,
    claim_gone,
    claim_reference,
    namespace_directory,
    not_a_pods_claim,
    pending_claim,
    volume_name,
)

logger = logging.getLogger(__name__)

ATTEMPTS = 4
"""Tries of one event's step when the API server is busy (1 + 2 + 4 s of back-off): a claim
sends no further event while it waits for its volume, so a step given up leaves its pod
Pending until the operator restarts."""


def serve_claim(kube: KubeClient, pvc: Mapping[str, Any], config: NodeCacheConfig) -> str | None:
    """Create the volume of `pvc` if it is a node-cache claim waiting for one; its name, or
    None when the claim needs none (yet)."""
    claim = pending_claim(pvc)
    if claim is None:
        if not_a_pods_claim(pvc):
            meta = pvc.get("metadata") or {}
            logger.warning("claim %s/%s of class %s is not served: only a pod's own ephemeral "
                           "claim is (its controller the pod it is named after); use an "
                           "ephemeral volume in the pod, or another StorageClass",
                           meta.get("namespace"), meta.get("name"), NODE_CACHE_CLASS)
        return None
    node = kube.get_node(claim.node)
    if node is None:  # the scheduler will choose again, and the claim's new annotation returns
        logger.warning("claim %s/%s names node %s, which does not exist; waiting for the "
                       "scheduler's next choice", claim.namespace, claim.name, claim.node)
        return None
    hostname = ((node.get("metadata") or {}).get("labels") or {}).get(HOSTNAME_LABEL, claim.node)
    volume = build_persistent_volume(claim, hostname, config)
    kube.create_volume(volume)
    logger.info("claim %s/%s served by %s: %s on node %s", claim.namespace, claim.name,
                volume["metadata"]["name"], namespace_directory(config, claim.namespace),
                claim.node)
    return str(volume["metadata"]["name"])


def release_claim(kube: KubeClient, pvc: Mapping[str, Any]) -> None:
    """The claim `pvc` was deleted: delete its volume (if it had one)."""
    meta = pvc.get("metadata") or {}
    kube.delete_volume(volume_name(meta["uid"]))


def reclaim_volume(kube: KubeClient, pv: Mapping[str, Any]) -> bool:
    """Delete `pv` if its claim is gone; whether it did."""
    namespace, name, _ = claim_reference(pv)
    live = kube.get_claim(namespace, name) if namespace and name else None
    if not claim_gone(pv, live):
        return False
    kube.delete_volume(pv["metadata"]["name"])
    logger.info("volume %s deleted: its claim %s/%s is gone (the node's cached bytes stay)",
                pv["metadata"]["name"], namespace, name)
    return True


def with_retries(step: Callable[[], Any], what: str, wait: Callable[[float], None]) -> None:
    """Run `step`; retry it while the API server answers with a transient error, `ATTEMPTS`
    times in all, waiting the back-off between tries (`wait`: kopf's handler thread sleeps, no
    event announces that the API server recovered)."""
    for attempt in range(ATTEMPTS):
        try:
            step()
            return
        except KubeTransientError as exc:
            if attempt + 1 == ATTEMPTS:
                logger.error("%s given up after %d tries: %s", what, ATTEMPTS, exc)
                return
            logger.warning("%s retried: %s", what, exc)
            wait(backoff_delay(attempt, exc.delay_s))
