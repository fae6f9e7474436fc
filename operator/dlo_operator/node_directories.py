"""The node agent's filesystem work: a namespace's node-cache directory, owned as the loader needs.

[Note: node directory ownership] The operator's PersistentVolume serves a claim with
`<root>/namespaces/<namespace>` as a hostPath of type `Directory` (`node_cache`), so the kubelet
mounts it only once it exists; until then the mount fails and the kubelet retries it. This module
makes that directory appear whole: `prepare` builds it under a staging name in `namespaces/`
(`cache/` owned by the loader's UID/GID, mode 0755: the loader writes it, every other user
only reads; `runtime/` and the namespace's directory root-owned, mode 0755) and renames it into
place; rename(2) is atomic, so the kubelet sees either no directory (mount retried) or the
prepared one, never a half-made one whose `cache/` its subPath mount would create root-owned.

The tree above `cache/` is root's (`<root>`, `namespaces/`, each namespace's directory and its
`runtime/`); tenants write only below `cache/` (the loader) and `runtime/<dod>` (the inference
container). Every name below `<root>` is opened with O_NOFOLLOW and worked on through its
descriptor (fchown, fchmod, *at calls), so a symlink planted anywhere here is refused, never
followed. Nothing below `cache/` or `runtime/` is read or changed, but for the one hand-over of
a `cache/` whose owner changes ([Note: hand-over] in `node_handover`: streamed, regular files
and directories only, set-ID bits cleared). Each namespace is worked on under a lock of its own
(`_lock_of`), so one namespace's hand-over of a million files delays no other namespace. With
`nodeCache.namespaceQuotaBytes` set, each namespace's directory gets its project quota
([Note: the cache filesystem] in `node_filesystem`) whenever it is prepared.

The agent needs CAP_CHOWN alone: it is uid 0 and owns what it creates (mkdir, chmod as owner);
to correct the mode of a directory it gave away it takes it back first (chown, chmod, chown).
`namespace_of` derives the namespace from a PersistentVolume's own spec and refuses any path
that is not exactly `<root>/namespaces/<namespace>` of the claim's namespace. Pure apart from
the filesystem; called by `node_agent`. It must not talk to the cluster.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Mapping
from typing import Any

from dlo_operator.errors import OperatorError
from dlo_operator.node_filesystem import QuotaUnavailable, set_project_quota
from dlo_operator.node_handover import HandOver, Owner, give_tree
from dlo_operator.node_cache import (
    CACHE_SUBPATH,
    NODE_CACHE_CLASS,
    PROVISIONED_BY,
    PROVISIONER,
    RUNTIME_SUBPATH,
    claim_reference,
)

logger = logging.getLogger(__name__)

NAMESPACES = "namespaces"
DIRECTORY_MODE = 0o755
"""Every directory the agent makes: its owner writes, everyone else reads and enters (the
inference container, any user, reads the entries the loader wrote)."""
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A namespace name (an RFC 1123 label): no '/', no '.', so never '..' nor a staging name."""
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_namespace_locks: dict[str, threading.Lock] = {}
"""kopf runs handlers of different volumes at once: two volumes of one namespace must not build
its directory twice (the second would find the first's staging directory half made). One lock
per namespace: a namespace is never waited on by another."""
_locks_guard = threading.Lock()
"""Held only to look a namespace's lock up, never while the disk is worked on."""


class NodeDirectoryError(OperatorError):
    """A volume or a node directory the agent refuses to prepare; a person must fix it."""


def is_node_cache_volume(pv: Mapping[str, Any]) -> bool:
    """Whether this operator made `pv` (its class and its provisioned-by annotation)."""
    meta, spec = pv.get("metadata") or {}, pv.get("spec") or {}
    return (spec.get("storageClassName") == NODE_CACHE_CLASS
            and (meta.get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER)


def namespace_of(pv: Mapping[str, Any], root: str) -> str:
    """The namespace whose directory `pv` serves: its `spec.hostPath.path` must be exactly
    `<root>/namespaces/<namespace>` with the namespace of its own `spec.claimRef`."""
    name = (pv.get("metadata") or {}).get("name")
    path = str(((pv.get("spec") or {}).get("hostPath") or {}).get("path") or "")
    namespace = claim_reference(pv)[0]
    expected = f"{root.rstrip('/')}/{NAMESPACES}/{namespace}"
    if not _NAMESPACE.match(namespace) or path != expected:
        raise NodeDirectoryError(
            f"PersistentVolume {name}: spec.hostPath.path={path!r} with "
            f"spec.claimRef.namespace={namespace!r} is not a node-cache directory; expected "
            f"{root.rstrip('/')}/{NAMESPACES}/<the claim's namespace>",
            hint="only the operator's volumes are prepared; check that the operator's "
                 "--node-cache-root and the agent's equal the chart's nodeCache.hostPath")
    return namespace


def prepare(root: str, namespace: str, owner: Owner, quota_bytes: int = 0) -> bool:
    """Make `<root>/namespaces/<namespace>` as [Note: node directory ownership] says, or bring
    an existing one to it, with its project quota if `quota_bytes`; whether the directory was
    created (False: it was there)."""
    if not _NAMESPACE.match(namespace):
        raise NodeDirectoryError(f"namespace {namespace!r} is not a namespace name",
                                 hint="pass a Kubernetes namespace name (an RFC 1123 label)")
    with _lock_of(namespace):
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the platform's
        try:
            parent = _directory(root_fd, NAMESPACES, root, create=True)
            try:
                _own(parent, Owner(0, 0))
                created = _prepare_in(parent, namespace, f"{root}/{NAMESPACES}", owner)
                if quota_bytes:
                    _quota(parent, namespace, quota_bytes, f"{root}/{NAMESPACES}")
                return created
            finally:
                os.close(parent)
        finally:
            os.close(root_fd)


def _lock_of(namespace: str) -> threading.Lock:
    with _locks_guard:
        return _namespace_locks.setdefault(namespace, threading.Lock())


def _quota(parent: int, namespace: str, limit: int, where: str) -> None:
    """The namespace's project quota, where the filesystem keeps one (logged where not: the
    directory serves its pods either way)."""
    fd = os.open(namespace, _OPEN_DIRECTORY, dir_fd=parent)
    try:
        for child in ("", CACHE_SUBPATH, RUNTIME_SUBPATH):
            child_fd = os.open(child, _OPEN_DIRECTORY, dir_fd=fd) if child else fd
            try:
                project = set_project_quota(child_fd, namespace, limit)
            finally:
                if child:
                    os.close(child_fd)
    except QuotaUnavailable as exc:
        logger.warning("%s/%s: no quota of %d bytes: %s (hint: %s)", where, namespace, limit,
                       exc, exc.hint)
        return
    finally:
        os.close(fd)
    logger.info("%s/%s: project %d, at most %d bytes", where, namespace, project, limit)


def _prepare_in(parent: int, namespace: str, where: str, owner: Owner) -> bool:
    try:
        fd = os.open(namespace, _OPEN_DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        _create(parent, namespace, where, owner)
        return True
    except OSError as exc:
        raise _refused(f"{where}/{namespace}", exc) from exc
    try:
        _repair(fd, f"{where}/{namespace}", owner)
    finally:
        os.close(fd)
    return False


def _create(parent: int, namespace: str, where: str, owner: Owner) -> None:
    """Build the tree under `.<namespace>.staging`, then rename it into place (atomic: the
    kubelet's `Directory` check never sees it half made)."""
    staging = f".{namespace}.staging"
    _remove_staging(parent, staging, where)  # left by an agent that stopped mid-way
    os.mkdir(staging, 0o700, dir_fd=parent)  # nobody else enters it before the rename
    fd = os.open(staging, _OPEN_DIRECTORY, dir_fd=parent)
    try:
        _repair(fd, f"{where}/{staging}", owner)
    finally:
        os.close(fd)
    os.rename(staging, namespace, src_dir_fd=parent, dst_dir_fd=parent)


def _remove_staging(parent: int, staging: str, where: str) -> None:
    """Remove a staging directory and the two empty directories it may hold (rmdir removes
    only empty directories and never follows a symlink: nothing else can be lost)."""
    try:
        fd = os.open(staging, _OPEN_DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _refused(f"{where}/{staging}", exc) from exc
    try:
        for child in (CACHE_SUBPATH, RUNTIME_SUBPATH):
            try:
                os.rmdir(child, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    os.rmdir(staging, dir_fd=parent)


def _repair(fd: int, where: str, owner: Owner) -> None:
    """The namespace's directory (`fd`): root's; its `cache/` the loader's; its `runtime/`
    root's (the kubelet makes `runtime/<dod>` when it mounts the subPath). A `cache/` that
    changes hands (written by an older, root loader, or before `nodeCache.uid` changed) gives
    its contents to the loader too, or the loader could neither evict nor replace them."""
    _own(fd, Owner(0, 0))
    for child, child_owner in ((CACHE_SUBPATH, owner), (RUNTIME_SUBPATH, Owner(0, 0))):
        child_fd = _directory(fd, child, where, create=True)
        try:
            if _own(child_fd, child_owner) and child == CACHE_SUBPATH:
                _give_contents(child_fd, f"{where}/{child}", child_owner)
        finally:
            os.close(child_fd)


def _give_contents(fd: int, where: str, owner: Owner) -> None:
    """Give the tree below the directory `fd` to `owner` ([Note: hand-over]), in one line."""
    counts = give_tree(fd, owner)
    if counts == HandOver():  # a new, empty cache/
        return
    logger.warning(
        "%s changed hands: %d files and directories given to %d:%d; %d links left as they were, "
        "%d device nodes, fifos or sockets removed, %d set-ID bits cleared, %d directories "
        "deeper than the walk left, %d names unreadable", where, counts.given, owner.uid,
        owner.gid, counts.links_left, counts.specials_removed, counts.set_id_cleared,
        counts.too_deep, counts.unreadable)


def _directory(parent: int, name: str, where: str, *, create: bool) -> int:
    """A descriptor of the directory `name` in `parent`, made (mode 0755) if missing; a symlink
    or anything else but a directory is refused."""
    if create:
        try:
            os.mkdir(name, DIRECTORY_MODE, dir_fd=parent)
        except FileExistsError:
            pass
    try:
        return os.open(name, _OPEN_DIRECTORY, dir_fd=parent)
    except OSError as exc:
        raise _refused(f"{where}/{name}", exc) from exc


def _own(fd: int, owner: Owner) -> bool:
    """Give the directory `fd` to `owner` with `DIRECTORY_MODE`, changing only what differs;
    whether its owner changed."""
    info = os.fstat(fd)
    changed = (info.st_uid, info.st_gid) != (owner.uid, owner.gid)
    if stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
        if (info.st_uid, info.st_gid) != (0, 0):
            os.fchown(fd, 0, 0)  # back to the agent first: fchmod needs the owner (or FOWNER)
            info = os.fstat(fd)
        os.fchmod(fd, DIRECTORY_MODE)
    if (info.st_uid, info.st_gid) != (owner.uid, owner.gid):
        os.fchown(fd, owner.uid, owner.gid)
    return changed


def _refused(path: str, exc: OSError) -> NodeDirectoryError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return NodeDirectoryError(
            f"{path} is not a directory (a symlink or a file): refused, the node agent never "
            "follows a link below the node cache's root",
            hint=f"remove {path} on the node (nothing but the agent creates it), and the agent "
                 "prepares it at the volume's next event or its own restart")
    return NodeDirectoryError(f"cannot open {path}: {exc.strerror}",
                              hint="check that the agent's hostPath volume is the chart's "
                                   "nodeCache.hostPath and that it runs with CAP_CHOWN")
