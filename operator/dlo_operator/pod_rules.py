"""Refusals that compare the DOD's settings with the pod it asks for.

Each rule has an id (in brackets in its message, like the settings validator's); settings fields
are named through the contract's `cr_names` (the operator reads CRs). They read the
container resources the user wrote as core/v1 objects, which the CRD keeps as free-form maps, so
the CRD cannot express them; the operator and `dlo render` check them through `admission`.
`[loader-backend-gloo]` alone has a CEL twin in the CRD with the same message. Pure.
"""

from __future__ import annotations

from dlo_operator.core_rules import PORT_NAME, quantity
from dlo_operator.host_paths import OWN_MOUNT_PATHS, overlaps, user_mount_paths
from dlo_contract.validation import cr_names
from dlo_operator.naming import Owner, selector_labels
from dlo_operator.node_cache import DEFAULT_RUNTIME_CACHE_PATH
from dlo_operator.pod import GPU_RESOURCE, OWN_VOLUMES
from dlo_operator.source_access import share_problems
from dlo_operator.spec import DeploymentSpec, runtime_cache_on

LOADER_BACKEND_MESSAGE = (
    f"[loader-backend-gloo] {cr_names('loader.backend')}=nccl needs a GPU, but the loader is a "
    f"CPU-only init container; fix: set {cr_names('loader.backend')}=gloo")


def pod_problems(spec: DeploymentSpec) -> list[str]:
    found = (_gpu_limit(spec), _ranks(spec), _loader_memory(spec), _backend(spec),
             _reserved_labels(spec), _volume_names(spec), _mounts(spec), _inference_ports(spec),
             _ports(spec), _cache_paths(spec), _runtime_cache_apart(spec))
    return [problem for problem in found if problem] + share_problems(spec)


def ranks_per_pod(spec: DeploymentSpec) -> int:
    """Processes the engine runs in one pod, one per GPU: the product of the parallel sizes
    (expert parallelism reuses these ranks; HSDP shards over its own ranks, not counted)."""
    p = spec.settings.parallel
    return p.dp * p.sp * p.tp * p.cfg_parallel * p.pp


def _gpu_limit(spec: DeploymentSpec) -> str | None:
    for kind in ("limits", "requests"):
        own = (spec.inference.resources.get(kind) or {}).get(GPU_RESOURCE)
        if own is not None and spec.gpus_per_pod and quantity(own) != spec.gpus_per_pod:
            return (f"[gpus-per-pod-resources] spec.inference.resources.{kind}"
                    f"[{GPU_RESOURCE!r}]={own!r} contradicts spec.gpusPerPod={spec.gpus_per_pod}; "
                    f"remove it (gpusPerPod sets the {GPU_RESOURCE} limit) or make them equal")
    return None


def _ranks(spec: DeploymentSpec) -> str | None:
    ranks = ranks_per_pod(spec)
    if not spec.gpus_per_pod or spec.settings.parallel.hsdp or ranks == spec.gpus_per_pod:
        return None
    p = spec.settings.parallel
    return (f"[gpus-per-pod-ranks] spec.parallel dp={p.dp} x sp={p.sp} x tp={p.tp} x "
            f"cfgParallel={p.cfg_parallel} x pp={p.pp} = {ranks} ranks per pod, but "
            f"spec.gpusPerPod={spec.gpus_per_pod} (one rank per GPU); set spec.gpusPerPod="
            f"{ranks} or change the parallel sizes")


def _loader_memory(spec: DeploymentSpec) -> str | None:
    limit = (spec.loader.resources.get("limits") or {}).get("memory")
    wanted = spec.settings.loader.memory_limit_bytes
    if limit is None or quantity(limit) is None or wanted < quantity(limit):
        return None
    field = cr_names("loader.memory_limit_bytes")
    return (f"[loader-memory-container-limit] {field}={wanted} does not fit "
            f"in the loader container's memory limit {limit!r} (the kernel would OOM-kill it); "
            f"lower {field} or raise spec.loader.resources.limits.memory, "
            "leaving room for the process itself")


def _backend(spec: DeploymentSpec) -> str | None:
    return LOADER_BACKEND_MESSAGE if spec.settings.loader.backend == "nccl" else None


def _reserved_labels(spec: DeploymentSpec) -> str | None:
    owned = sorted(set(spec.pod_labels) & set(selector_labels(Owner(name="x", namespace="x"))))
    if not owned:
        return None
    return (f"[pod-labels-reserved] spec.podLabels sets {', '.join(owned)}, which the operator "
            "uses to select the DOD's pods; remove them")


def _volume_names(spec: DeploymentSpec) -> str | None:
    names = [str(v.get("name", "")) for v in spec.volumes]
    taken = sorted({n for n in names if n in OWN_VOLUMES or names.count(n) > 1})
    if not taken:
        return None
    return (f"[volume-names] spec.volumes names {', '.join(map(repr, taken))} more than once or "
            f"as one of the operator's own volumes ({', '.join(OWN_VOLUMES)}); rename them")


def _mounts(spec: DeploymentSpec) -> str | None:
    names = {str(v.get("name", "")) for v in spec.volumes}
    unknown = sorted({str(m.get("name", "")) for m in spec.inference.volume_mounts} - names)
    if not unknown:
        return None
    names = ", ".join(map(repr, unknown))
    return (f"[volume-mounts-known] spec.inference.volumeMounts mounts {names}, which "
            "spec.volumes does not define; add the volume or remove the mount")


def _cache_paths(spec: DeploymentSpec) -> str | None:
    """Where the containers see the node cache may not hide, or lie in, a mount of their own
    (the settings, the entry file, scratch space, shared memory, a user volume)."""
    settings = spec.settings
    paths = [("cache.hostPath", settings.cache.root)]
    if runtime_cache_on(settings):
        paths.append(("offload.runtimeCacheRoot", settings.runtime_cache_root))
    own = [*OWN_MOUNT_PATHS, *user_mount_paths(spec)]
    for field, path in paths:
        clash = next((mount for mount in own if overlaps(path, mount)), None)
        if clash is not None:
            return (f"spec.{field}={path!r} overlaps the container mount path {clash!r}; "
                    "choose a directory that neither contains nor lies inside it")
    return None


def _runtime_cache_apart(spec: DeploymentSpec) -> str | None:
    """The inference container mounts the entries read-only at `cache.hostPath` and its DOD's
    runtime cache writable at `offload.runtimeCacheRoot`: one inside the other would hide one
    mount under the other (and the same path cannot be both)."""
    settings = spec.settings
    if not runtime_cache_on(settings) or not overlaps(settings.runtime_cache_root,
                                                      settings.cache.root):
        return None
    default = (" (the default of an empty runtimeCacheRoot)"
               if settings.runtime_cache_root == DEFAULT_RUNTIME_CACHE_PATH else "")
    runtime_root, host_path = cr_names("offload.runtime_cache_root"), cr_names("cache.root")
    return (f"[runtime-cache-apart] {runtime_root}={settings.runtime_cache_root!r}{default} and "
            f"{host_path}={settings.cache.root!r} overlap; the entries are read-only in the "
            f"inference container and its runtime cache is writable: set {runtime_root} to a "
            f"path that neither contains nor lies inside {host_path}")


_PROTOCOLS = ("TCP", "UDP", "SCTP")


def _inference_ports(spec: DeploymentSpec) -> str | None:
    """Each `spec.inference.ports` item becomes a container port of the StatefulSet's template
    and a port of the inference Service. One the API server refuses (no number, a name it does
    not take, a name used twice) would fail the StatefulSet's every apply and leave the DOD
    without pods; it is refused here, naming the item."""
    named: dict[str, str] = {}
    for index, port in enumerate(spec.inference.ports):
        field = f"spec.inference.ports[{index}]"
        number = port.get("containerPort")
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
            return (f"[inference-ports-valid] {field}.containerPort={number!r} is not a port "
                    "number; set an integer from 1 to 65535")
        name = port.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 15
                                 or not PORT_NAME.match(name)):
            return (f"[inference-ports-valid] {field}.name={name!r} is not a port name; use at "
                    "most 15 lowercase letters, digits and '-', with a letter, no '-' at either "
                    "end and no '--'")
        if name is not None and name in named:
            return (f"[inference-ports-valid] {field}.name={name!r} is also {named[name]}.name; "
                    "give each port its own name")
        if name is not None:
            named[name] = field
        protocol = port.get("protocol", "TCP")
        if protocol not in _PROTOCOLS:
            return (f"[inference-ports-valid] {field}.protocol={protocol!r} is not one of "
                    f"{', '.join(_PROTOCOLS)}; use one of them")
    return None


def _ports(spec: DeploymentSpec) -> str | None:
    """The pod's containers share one network namespace: a port the loader binds (its
    rendezvous, its metrics) and the server's own ports must differ, or one of them fails to
    start with "address already in use" and the pod crash-loops."""
    taken: dict[int, list[str]] = {}
    loader = spec.settings.loader
    named = [("spec.loader.port", spec.loader.port),
             (cr_names("loader.metrics_port"), loader.metrics_port)]
    named += [(f"spec.inference.ports[{index}].containerPort", port.get("containerPort"))
              for index, port in enumerate(spec.inference.ports)]
    for field, port in named:
        if isinstance(port, int) and port > 0:
            taken.setdefault(port, []).append(field)
    clashes = [(port, fields) for port, fields in taken.items() if len(fields) > 1]
    if not clashes:
        return None
    port, fields = clashes[0]
    return (f"[pod-ports-distinct] {' and '.join(fields)} are both {port}; the pod's containers "
            "share one network, so one of them could not bind it: choose distinct ports")
