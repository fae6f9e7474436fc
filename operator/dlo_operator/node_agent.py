"""`dlo node-agent run`: prepare this node's node-cache directories before pods mount them.

One agent runs on each node that may run DOD pods (the chart's DaemonSet, in the operator's
namespace). It watches the operator's PersistentVolumes (label `dlo.dev/node-cache`) that name
its node (annotation `NODE_ANNOTATION`, which the operator sets from the claim's node) and
prepares the directory each one serves (`node_directories.prepare`, see [Note: node directory
ownership] there): the volume's hostPath has type `Directory`, so the kubelet's mount fails, and
is retried, until the agent renamed the prepared directory into place. Every volume is
prepared again at its next event and at the agent's start (kopf lists the volumes first), so a
refusal fixed on the node (a planted symlink removed) needs `kubectl rollout restart` of the
DaemonSet, no change to the volume. (No kopf timer: it would put a finalizer on each volume,
which needs `patch`.)

Its privileges, all needed and no more: the hostPath of the platform's root (`nodeCache.hostPath`)
alone, uid 0 with only CAP_CHOWN (it owns what it creates; CHOWN gives `cache/` to the loader's
UID/GID; CAP_SYS_ADMIN too only with `nodeCache.namespaceQuotaBytes`, for quotactl), a read-only
root filesystem, and get/list/watch on PersistentVolumes (no writes to the cluster: kopf's event
posting is off). Volumes of other nodes and of other provisioners are ignored. At its start it
warns if the cache filesystem lacks `nosuid,nodev,noexec` ([Note: the cache filesystem] in
`node_filesystem`). Its memory does not grow with the files tenants write (`node_handover`).
Imports kopf only when the command runs; `build_registry` is what tests run.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlo_contract.deployment import DEFAULT_LOADER_UID
from dlo_operator.errors import OperatorError
from dlo_operator.installation import add_owner_flags, byte_count, node_cache_root
from dlo_operator.node_cache import DEFAULT_NODE_CACHE_ROOT, LABEL_NODE_CACHE, NODE_ANNOTATION
from dlo_operator.node_directories import (
    NodeDirectoryError,
    is_node_cache_volume,
    namespace_of,
    prepare,
)
from dlo_operator.node_filesystem import REQUIRED_MOUNT_OPTIONS, missing_mount_options
from dlo_operator.node_handover import Owner

logger = logging.getLogger(__name__)

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


@dataclass(frozen=True)
class NodeAgentConfig:
    """What one agent prepares: its node, the platform's root, and the loader's owner."""

    node: str
    """This node's name (the DaemonSet passes `spec.nodeName` through the downward API)."""
    root: str = DEFAULT_NODE_CACHE_ROOT
    """The node directory holding `namespaces/<namespace>` (chart `nodeCache.hostPath`)."""
    owner: Owner = Owner(DEFAULT_LOADER_UID, DEFAULT_LOADER_UID)
    """The loader's UID/GID, owner of each `cache/` (chart `nodeCache.uid`, `nodeCache.gid`)."""
    quota_bytes: int = 0
    """Each namespace's project quota where the filesystem keeps them, 0 for none (chart
    `nodeCache.namespaceQuotaBytes`)."""


def prepare_volume(pv: Mapping[str, Any], config: NodeAgentConfig) -> str | None:
    """Prepare the directory `pv` serves if it is this operator's volume of this node; the
    namespace prepared, or None when the volume is not the agent's or is refused (logged)."""
    meta = pv.get("metadata") or {}
    if (not is_node_cache_volume(pv)
            or (meta.get("annotations") or {}).get(NODE_ANNOTATION) != config.node):
        return None
    try:
        namespace = namespace_of(pv, config.root)
        created = prepare(config.root, namespace, config.owner, config.quota_bytes)
    except NodeDirectoryError as exc:
        logger.error("volume %s not prepared: %s (hint: %s)", meta.get("name"), exc, exc.hint)
        return None
    except OSError as exc:  # the disk itself (EIO, ENOSPC)
        logger.error("volume %s not prepared: %s; retried at its next event or the agent's "
                     "restart", meta.get("name"), exc)
        return None
    if created:
        logger.info("volume %s: %s/namespaces/%s prepared (cache/ owned by %d:%d)",
                    meta.get("name"), config.root, namespace, config.owner.uid,
                    config.owner.gid)
    return namespace


def check_mount(root: str) -> tuple[str, ...]:
    """Warn if the filesystem of `root` lacks `REQUIRED_MOUNT_OPTIONS`; the options missing."""
    mount, missing = missing_mount_options(root)
    if missing:
        logger.warning(
            "the node cache %s is on %s (%s) mounted without %s: a file a pod writes there could "
            "be a device it opens, a set-user-ID program or code it runs (the agent removes "
            "device nodes and clears set-ID bits only when it hands a tree over); mount that "
            "filesystem with %s, e.g. a disk of its own with those options in /etc/fstab",
            root, mount.point, mount.fstype, ",".join(missing), ",".join(REQUIRED_MOUNT_OPTIONS))
    return missing


def build_registry(config: NodeAgentConfig) -> Any:
    """The agent's kopf handlers, bound to `config`."""
    import kopf

    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        """Read-only in the cluster: no events posted, no scanning, no peering."""
        settings.posting.enabled = False
        settings.scanning.disabled = True
        settings.peering.standalone = True

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)

    @kopf.on.event("persistentvolumes", labels={LABEL_NODE_CACHE: kopf.PRESENT},
                   annotations={NODE_ANNOTATION: config.node}, registry=registry)
    def on_volume(type: str | None, body: kopf.Body, **_: Any) -> None:
        if type != "DELETED":
            prepare_volume(body, config)

    return registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-name", required=True, metavar="NODE",
                        help="this node's name (the DaemonSet passes spec.nodeName)")
    parser.add_argument("--node-cache-root", type=node_cache_root,
                        default=DEFAULT_NODE_CACHE_ROOT, metavar="DIR",
                        help="node directory holding each namespace's cache, "
                        f"DIR/namespaces/NAMESPACE (default {DEFAULT_NODE_CACHE_ROOT})")
    add_owner_flags(parser)
    parser.add_argument("--namespace-quota-bytes", type=byte_count, default=0, metavar="BYTES",
                        help="each namespace's project quota on the cache filesystem, where it "
                        "keeps them (XFS, ext4 with prjquota; needs CAP_SYS_ADMIN); default 0: "
                        "none")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help=f"liveness endpoint served by the agent (default {DEFAULT_LIVENESS})")


def run(args: argparse.Namespace) -> int:
    import kopf

    if not args.node_name:
        raise OperatorError("--node-name is empty",
                            hint="pass the node's name, e.g. from the downward API spec.nodeName")
    config = NodeAgentConfig(node=args.node_name, root=args.node_cache_root,
                             owner=Owner(args.node_cache_uid, args.node_cache_gid),
                             quota_bytes=args.namespace_quota_bytes)
    check_mount(config.root)
    kopf.run(registry=build_registry(config), clusterwide=True, standalone=True,
             liveness_endpoint=args.liveness)
    return 0
