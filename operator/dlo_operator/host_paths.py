"""Which node directories a DOD may mount: the installation's allowlist and the pod's own paths.

The loader runs as root and writes `cache.hostPath`; the inference container may write
`offload.runtimeCacheRoot`. Both must be absolute and normalized (the CRD's pattern), lie under
one of the allowed host paths (the chart's `allowedHostPaths`, the operator's
`--allowed-host-path`, default `/var/lib/dlo`), and must not overlap the paths the containers
mount for themselves, where a hostPath would hide the settings, the entry file or a user volume.
The CRD cannot know the allowlist (an installation choice), so only the operator and
`dlo render` check it. Pure; called by `admission`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence

from dlo_contract.names import DEFAULT_CACHE_ROOT, RUN_DIR, SETTINGS_MOUNT
from dlo_operator.naming import LOADER_TMP, SHM_PATH
from dlo_operator.spec import DeploymentSpec

DEFAULT_ALLOWED_HOST_PATHS: tuple[str, ...] = ("/var/lib/dlo",)
OWN_MOUNT_PATHS: tuple[str, ...] = (SETTINGS_MOUNT, RUN_DIR, LOADER_TMP, SHM_PATH)
"""Where the operator mounts its own volumes in the containers (settings, entry file, the
loader's scratch space, shared memory)."""


def normalized(path: str) -> bool:
    return path.startswith("/") and posixpath.normpath(path) == path and path != "/" and (
        not path.startswith("//"))


def within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def overlaps(a: str, b: str) -> bool:
    return within(a, b) or within(b, a)


def host_path_problems(paths: Sequence[tuple[str, str]], *, allowed: Sequence[str],
                       user_mounts: Iterable[str] = ()) -> list[str]:
    """One message per problem; `paths` pairs each CR field (as the user writes it) with its
    value. Two host paths may be equal (one volume) but not nested in each other."""
    problems: list[str] = []
    own = [*OWN_MOUNT_PATHS, *user_mounts]
    for field, path in paths:
        if not normalized(path):
            problems.append(
                f"spec.{field}={path!r} must be an absolute, normalized path "
                f"(e.g. {DEFAULT_CACHE_ROOT!r})")
            continue
        if not any(within(path, root) for root in allowed):
            problems.append(
                f"spec.{field}={path!r} is outside the allowed host paths "
                f"({', '.join(allowed)}); use a directory below one of them, or ask the "
                "cluster administrator to add it (chart value allowedHostPaths)")
        clash = next((mount for mount in own if overlaps(path, mount)), None)
        if clash is not None:
            problems.append(
                f"spec.{field}={path!r} overlaps the container mount path {clash!r}; "
                "choose a directory that neither contains nor lies inside it")
    checked = [(f, p) for f, p in paths if normalized(p)]
    for i, (field_a, a) in enumerate(checked):
        for field_b, b in checked[i + 1:]:
            if a != b and overlaps(a, b):
                problems.append(
                    f"spec.{field_b}={b!r} and spec.{field_a}={a!r} are nested; use the same "
                    "directory or two separate ones")
    return problems


def host_paths_of(spec: DeploymentSpec) -> list[tuple[str, str]]:
    """The DOD's host directories, each with its CR field."""
    paths = [("cache.hostPath", spec.settings.cache.root)]
    if spec.settings.offload.runtime_cache_root:
        paths.append(("offload.runtimeCacheRoot", spec.settings.offload.runtime_cache_root))
    return paths


def user_mount_paths(spec: DeploymentSpec) -> list[str]:
    """Where the user's own volumes are mounted in the inference container."""
    return [str(m.get("mountPath", "")) for m in spec.inference.volume_mounts]
