"""Which node directories a DOD may mount, and the path comparisons `pod_rules` shares.

`cache.hostPath` and `offload.runtimeCacheRoot` are paths in the containers, never node
directories: the node directory is the platform's (`node_cache`), and `pod_rules` keeps the two
paths off the containers' own mounts (`OWN_MOUNT_PATHS`, `user_mount_paths`). Both lie under the
platform's prefix (chart value `cachePathPrefix`, `cache_path_problems`), which itself may not
overlap a directory the loader image runs code from (`LOADER_CODE_DIRECTORIES`): the loader mounts
the cache writable, so a cache at `/usr/local/bin` would let a file in it answer for `dlo`.

A DOD's own `spec.volumes` reach the node only where the platform allows: a hostPath must lie
under the chart's `allowedUserHostPaths` (`--allowed-user-host-path`, default none) and outside
the node cache's directories (the cache reaches pods only through the operator's own volumes);
`gitRepo` and `flexVolume`, which make the kubelet run a program on the node with what the pod
wrote, are refused outright, and so is an ephemeral volume of the node cache's StorageClass
(`node_cache.NODE_CACHE_CLASS`, which the operator serves with the namespace's node cache
directory) and a `persistentVolumeClaim` naming a pod's node-cache claim (`<pod>-node-cache`,
`node_cache.is_pod_cache_claim_name`): a volume of `model.share` is one of these. Paths are
compared segment by segment, never as strings (`/var/lib/dlo-evil` is not under `/var/lib/dlo`).
Pure; called by `admission`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from dlo_contract.names import DEFAULT_CACHE_ROOT, FILL_SECRET_MOUNT, RUN_DIR, SETTINGS_MOUNT
from dlo_contract.source_credentials import SOURCE_CREDENTIALS_MOUNT
from dlo_contract.validation import cr_names
from dlo_operator.naming import LOADER_TMP, SHM_PATH
from dlo_operator.node_cache import NODE_CACHE_CLASS, is_pod_cache_claim_name
from dlo_operator.spec import DeploymentSpec, runtime_cache_on

DEFAULT_ALLOWED_HOST_PATHS: tuple[str, ...] = ("/var/lib/dlo",)
DEFAULT_CACHE_PATH_PREFIX = posixpath.dirname(DEFAULT_CACHE_ROOT)
"""Where `cache.hostPath` and `offload.runtimeCacheRoot` may lie in the containers (`/var/lib/dlo`,
chart value `cachePathPrefix`): the directory of their defaults."""
LOADER_CODE_DIRECTORIES: tuple[str, ...] = (
    "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/opt")
"""Where the loader image finds programs and libraries (its PATH, `/usr/local/bin:/usr/local/sbin:
/usr/sbin:/usr/bin:/sbin:/bin`, the dynamic linker's paths and `ld.so.preload` under `/etc`, and
Python's `/usr/local/lib/python3.*`): `cachePathPrefix` may neither contain nor lie in one."""
OWN_MOUNT_PATHS: tuple[str, ...] = (SETTINGS_MOUNT, RUN_DIR, LOADER_TMP, SHM_PATH,
                                     SOURCE_CREDENTIALS_MOUNT, FILL_SECRET_MOUNT)
"""Where the operator mounts its own volumes in the containers (settings, entry file, the
loader's scratch space, shared memory, the source's key file, the DOD's fill secret)."""


def normalized(path: str) -> bool:
    return path.startswith("/") and posixpath.normpath(path) == path and path != "/" and (
        not path.startswith("//"))


def within(path: str, root: str) -> bool:
    """`path` is `root` or lies below it, segment by segment: `/var/lib/dlo-evil` is not below
    `/var/lib/dlo`. Both are normalized (`normalized`; the chart's schema checks the roots)."""
    return PurePosixPath(path).is_relative_to(PurePosixPath(root))


def overlaps(a: str, b: str) -> bool:
    return within(a, b) or within(b, a)


def user_mount_paths(spec: DeploymentSpec) -> list[str]:
    """Where the user's own volumes are mounted in the inference container."""
    return [str(m.get("mountPath", "")) for m in spec.inference.volume_mounts]


NODE_PROGRAM_VOLUMES: dict[str, str] = {
    "gitRepo": "the kubelet runs git on the node, as root, with the repository the pod names "
    "(CVE-2024-10220); clone it in an init container into an emptyDir instead",
    "flexVolume": "the kubelet runs the node's driver program with the options the pod gives; "
    "use a CSI volume or a persistentVolumeClaim instead",
}
"""Volume types that reach the node other than through a hostPath; no chart value allows them."""


def user_volume_problems(volumes: Sequence[Mapping[str, Any]], *, allowed: Sequence[str],
                         cache_roots: Sequence[tuple[str, str]]) -> list[str]:
    """One message per `spec.volumes` item that reaches the node where the platform did not
    allow it. `allowed` is the chart's `allowedUserHostPaths`, `cache_roots` the node cache's
    directories, which user volumes may not overlap, each with the chart value that sets it."""
    problems: list[str] = []
    for index, volume in enumerate(volumes):
        field = f"spec.volumes[{index}]"
        problems += [f"{field}.{kind} is refused: {why}" for kind, why in
                     NODE_PROGRAM_VOLUMES.items() if kind in volume]
        problems += [problem] if (problem := _node_cache_claim_problem(field, volume)) else []
        if "hostPath" in volume:
            problem = _user_host_path_problem(f"{field}.hostPath.path", volume["hostPath"],
                                              allowed, cache_roots)
            problems += [problem] if problem else []
    return problems


def cache_path_problems(spec: DeploymentSpec, prefix: str) -> list[str]:
    """`cache.hostPath`, and `offload.runtimeCacheRoot` where the runtime cache mounts it, outside
    the platform's `prefix` (chart value `cachePathPrefix`), compared segment by segment."""
    paths = [("cache.root", spec.settings.cache.root)]
    if runtime_cache_on(spec.settings):
        paths.append(("offload.runtime_cache_root", spec.settings.runtime_cache_root))
    return [f"{cr_names(name)}={path!r} is not under {prefix}, the directory the platform sets "
            "aside for the node cache in the containers (chart value cachePathPrefix); mounted "
            "writable elsewhere, the cache could shadow the programs and libraries a container "
            "runs (the loader's PATH and library path, e.g. /usr/local/bin): choose a directory "
            f"under {prefix}"
            for name, path in paths if not within(path, prefix)]


def cache_path_prefix_problem(prefix: str) -> str | None:
    """Why the platform's `cachePathPrefix` may not be `prefix`, or None."""
    if not normalized(prefix):
        return (f"{prefix!r} is not an absolute, normalized directory; pass one like "
                f"{DEFAULT_CACHE_PATH_PREFIX} (no '.', '..', '//' or trailing '/')")
    clash = next((code for code in LOADER_CODE_DIRECTORIES if overlaps(prefix, code)), None)
    if clash is not None:
        return (f"{prefix!r} overlaps {clash}, where the loader image finds its programs or "
                "libraries; the loader mounts the cache writable there, so pass a directory of "
                f"its own, like {DEFAULT_CACHE_PATH_PREFIX}")
    return None


def _node_cache_claim_problem(field: str, volume: Mapping[str, Any]) -> str | None:
    """A claim of the node cache's class, a generic ephemeral one or a pod's own by its name,
    would give the DOD the namespace's node cache directory, writable wherever it mounts it."""
    claim = str((volume.get("persistentVolumeClaim") or {}).get("claimName") or "")
    if is_pod_cache_claim_name(claim):
        return (f"{field}.persistentVolumeClaim.claimName={claim!r} names a pod's node-cache "
                "claim (every claim named <pod>-node-cache may be one), which only the "
                "operator's own volumes may mount (the node cache reaches a DOD's containers "
                "read-only, through them); name another claim")
    template = (volume.get("ephemeral") or {}).get("volumeClaimTemplate") or {}
    chosen = (template.get("spec") or {}).get("storageClassName")
    if chosen != NODE_CACHE_CLASS:
        return None
    return (f"{field}.ephemeral.volumeClaimTemplate.spec.storageClassName={chosen!r} is the node "
            "cache's class, which only the operator's own volumes may claim (the node cache "
            "reaches a DOD's containers read-only, through them); choose another StorageClass")


def _user_host_path_problem(field: str, source: Any, allowed: Sequence[str],
                            cache_roots: Sequence[tuple[str, str]]) -> str | None:
    path = source.get("path") if isinstance(source, Mapping) else None
    if not isinstance(path, str) or not (normalized(path) or path == "/"):
        return (f"{field}={path!r} must be an absolute, normalized path (no '.', '..', '//' or "
                "trailing '/')")
    if not any(within(path, root) for root in allowed):
        listed = f"allowed: {', '.join(allowed)}" if allowed else "none is allowed"
        return (f"{field}={path!r} is not under a node directory the platform lets DODs mount "
                f"(chart value allowedUserHostPaths; {listed}); use another volume type "
                "(emptyDir, persistentVolumeClaim, configMap, secret), or ask the cluster "
                "administrator to add a directory to allowedUserHostPaths")
    clash = next(((root, value) for root, value in cache_roots if overlaps(path, root)), None)
    if clash is not None:
        return (f"{field}={path!r} overlaps the node cache directory {clash[0]!r} (chart value "
                f"{clash[1]}), which pods reach only through the operator's own volumes; mount a "
                "directory outside it")
    return None
