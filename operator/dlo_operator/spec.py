"""The DOD spec (camelCase, as the user writes it) parsed into typed, validated configuration.

`parse_spec` is the one place the operator reads a CR spec: it fills the same defaults as the CRD
(the API server applies those, but `dlo render` and a cluster without the CRD's defaulting do not),
builds the `dlo_contract.settings.Settings` document and runs `dlo_contract.validation.validate` on
it, so the operator rejects exactly what the runtime would. Called by the handlers and by
`dlo render`; it must not talk to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlo_operator.errors import SpecError
from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT
from dlo_contract.settings import Settings, SettingsError
from dlo_contract.validation import validate

SETTINGS_FIELDS: tuple[tuple[str, str], ...] = (
    ("model.source", "loader.source"),
    ("model.include", "loader.include"),
    ("model.endpointUrl", "loader.endpoint_url"),
    ("model.region", "loader.region"),
    ("model.pathStyle", "loader.path_style"),
    ("parallel.dp", "parallel.dp"),
    ("parallel.sp", "parallel.sp"),
    ("parallel.tp", "parallel.tp"),
    ("parallel.hsdp", "parallel.hsdp"),
    ("parallel.cfgParallel", "parallel.cfg_parallel"),
    ("parallel.pp", "parallel.pp"),
    ("parallel.ep", "parallel.ep"),
    ("offload.enabled", "offload.enabled"),
    ("offload.useAllgather", "offload.use_allgather"),
    ("offload.residentLayers", "offload.resident_layers"),
    ("offload.enableRuntimeCache", "offload.enable_runtime_cache"),
    ("offload.runtimeCacheRoot", "offload.runtime_cache_root"),
    ("offload.runtimeCacheLockTimeoutSeconds", "offload.runtime_cache_lock_timeout_s"),
    ("offload.runtimeCachePinLimitGiB", "offload.runtime_cache_pin_limit_gib"),
    ("offload.modelCpuOffload", "offload.model_cpu_offload"),
    ("offload.layerwiseCpuOffload", "offload.layerwise_cpu_offload"),
    ("quantization", "quantization"),
    ("cache.hostPath", "cache.root"),
    ("cache.maxBytes", "cache.max_bytes"),
    ("cache.minFreeBytes", "cache.min_free_bytes"),
    ("cache.verify", "cache.verify"),
    ("loader.mode", "loader.mode"),
    ("loader.readers", "loader.readers"),
    ("loader.chunkBytes", "loader.chunk_bytes"),
    ("loader.rendezvousTimeoutSeconds", "loader.rendezvous_timeout_s"),
    ("loader.onRendezvousTimeout", "loader.on_rendezvous_timeout"),
    ("loader.memoryLimitBytes", "loader.memory_limit_bytes"),
    ("loader.backend", "loader.backend"),
    ("loader.maxRetries", "loader.max_retries"),
    ("loader.timeoutSeconds", "loader.timeout_s"),
)
"""CR spec path -> settings path. The CRD's defaults for these fields are the settings defaults."""

_EMPTY_MEANS_NONE = frozenset({
    "loader.endpoint_url", "loader.region", "offload.runtime_cache_root",
})
"""Optional strings: the CRD defaults them to "" (structural schemas have no null default)."""

DEFAULT_LOADER_IMAGE = "dlo-loader:0.1.0"
"""The loader image when neither the DOD nor the operator (`--loader-image`, the chart's
`loaderImage`) names one."""
DEFAULT_LOADER_RESOURCES: dict[str, Any] = {
    "requests": {"cpu": "1", "memory": "2Gi"},
    "limits": {"memory": "4Gi"},
}
"""Room for the loader's chunk buffers (`loader.memoryLimitBytes`, 1 GiB by default) plus torch."""


@dataclass(frozen=True, kw_only=True)
class CredentialsConfig:
    """Where the loader's S3 credentials come from. An empty `secret_name` leaves the SDK chain
    to the pod's service account (web identity) or the node."""

    secret_name: str = ""
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"
    session_token_key: str = "AWS_SESSION_TOKEN"
    """Read only if present in the Secret (temporary credentials)."""


@dataclass(frozen=True, kw_only=True)
class LoaderPodConfig:
    """The loader init container's image, rendezvous port and resources."""

    image: str = DEFAULT_LOADER_IMAGE
    image_pull_policy: str = "IfNotPresent"
    port: int = DEFAULT_RENDEZVOUS_PORT
    """TCP port of the torch.distributed rendezvous on pod 0."""
    resources: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_LOADER_RESOURCES))


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """The user's inference server container (it imports `dlo_runtime`)."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    ports: tuple[Mapping[str, Any], ...] = ()
    readiness_probe: Mapping[str, Any] = field(default_factory=dict)
    """Empty means no probe: the pod is Ready once its containers run."""
    startup_probe: Mapping[str, Any] = field(default_factory=dict)
    """Holds off the liveness probe while the server maps the cache and warms up."""
    liveness_probe: Mapping[str, Any] = field(default_factory=dict)
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    """Mounts of the user's `volumes` (core/v1 VolumeMount)."""


@dataclass(frozen=True, kw_only=True)
class DisruptionBudgetConfig:
    """An optional PodDisruptionBudget over the workload pods (voluntary evictions, drains)."""

    enabled: bool = False
    max_unavailable: int | str = 1
    """Pods that a drain may evict at once: a count or a percentage such as "25%"."""


@dataclass(frozen=True, kw_only=True)
class DeploymentSpec:
    """Everything the builders need, typed and validated."""

    replicas: int = 1
    """Nodes: one pod per node, each pod one inference engine owning the node's GPUs."""
    gpus_per_pod: int = 1
    settings: Settings
    credentials: CredentialsConfig = field(default_factory=CredentialsConfig)
    loader: LoaderPodConfig = field(default_factory=LoaderPodConfig)
    inference: InferenceConfig
    service_account_name: str = ""
    automount_service_account_token: bool = False
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str = ""
    runtime_class_name: str = ""
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[Mapping[str, Any], ...] = ()
    """The user's own pod volumes (core/v1 Volume), mounted by `inference.volume_mounts`."""
    shm_size: str = ""
    """Size limit of the memory-backed /dev/shm; empty: no limit beyond the pod's memory."""
    disruption_budget: DisruptionBudgetConfig = field(default_factory=DisruptionBudgetConfig)


def parse_spec(spec: Mapping[str, Any] | None, *,
               default_loader_image: str = DEFAULT_LOADER_IMAGE) -> DeploymentSpec:
    """Turn a CR spec into a `DeploymentSpec`; raise `SpecError` with the validator's message.
    An empty `loader.image` takes `default_loader_image` (the chart's `loaderImage`)."""
    spec = spec or {}
    settings = _settings(spec)
    replicas = _int(spec, "replicas", 1, minimum=1)
    if not _get(spec, "inference.image", ""):
        raise SpecError(
            "spec.inference.image is required: the image of the inference server",
            hint="set spec.inference.image",
        )
    return DeploymentSpec(
        replicas=replicas,
        gpus_per_pod=_int(spec, "gpusPerPod", 1, minimum=0),
        settings=settings,
        credentials=CredentialsConfig(
            secret_name=_get(spec, "model.credentials.secretName", ""),
            access_key_id_key=_get(spec, "model.credentials.accessKeyIdKey", "AWS_ACCESS_KEY_ID"),
            secret_access_key_key=_get(
                spec, "model.credentials.secretAccessKeyKey", "AWS_SECRET_ACCESS_KEY"
            ),
            session_token_key=_get(spec, "model.credentials.sessionTokenKey", "AWS_SESSION_TOKEN"),
        ),
        loader=LoaderPodConfig(
            image=_get(spec, "loader.image", "") or default_loader_image,
            image_pull_policy=_get(spec, "loader.imagePullPolicy", "IfNotPresent"),
            port=_int(spec, "loader.port", DEFAULT_RENDEZVOUS_PORT, minimum=1),
            resources=_get(spec, "loader.resources", DEFAULT_LOADER_RESOURCES),
        ),
        inference=InferenceConfig(
            image=_get(spec, "inference.image", ""),
            image_pull_policy=_get(spec, "inference.imagePullPolicy", "IfNotPresent"),
            command=tuple(_get(spec, "inference.command", ())),
            args=tuple(_get(spec, "inference.args", ())),
            env=tuple(_get(spec, "inference.env", ())),
            resources=_get(spec, "inference.resources", {}),
            ports=tuple(_get(spec, "inference.ports", ())),
            readiness_probe=_get(spec, "inference.readinessProbe", {}),
            startup_probe=_get(spec, "inference.startupProbe", {}),
            liveness_probe=_get(spec, "inference.livenessProbe", {}),
            volume_mounts=tuple(_get(spec, "inference.volumeMounts", ())),
        ),
        service_account_name=_get(spec, "serviceAccountName", ""),
        automount_service_account_token=bool(_get(spec, "automountServiceAccountToken", False)),
        node_selector=_get(spec, "nodeSelector", {}),
        tolerations=tuple(_get(spec, "tolerations", ())),
        affinity=_get(spec, "affinity", {}),
        image_pull_secrets=tuple(_get(spec, "imagePullSecrets", ())),
        priority_class_name=_get(spec, "priorityClassName", ""),
        runtime_class_name=_get(spec, "runtimeClassName", ""),
        pod_labels=_get(spec, "podLabels", {}),
        pod_annotations=_get(spec, "podAnnotations", {}),
        volumes=tuple(_get(spec, "volumes", ())),
        shm_size=str(_get(spec, "shmSize", "")),
        disruption_budget=DisruptionBudgetConfig(
            enabled=bool(_get(spec, "disruptionBudget.enabled", False)),
            max_unavailable=_count_or_percent(_get(spec, "disruptionBudget.maxUnavailable", 1)),
        ),
    )


def settings_from_spec(spec: Mapping[str, Any]) -> Settings:
    """The settings document of a CR spec, before validation (used by the CEL agreement tests)."""
    document: dict[str, dict[str, Any]] = {}
    for cr_path, settings_path in SETTINGS_FIELDS:
        value = _get(spec, cr_path, None)
        if value is None:
            continue
        if settings_path in _EMPTY_MEANS_NONE and value == "":
            value = None
        section, _, name = settings_path.rpartition(".")
        document.setdefault(section, {})[name] = value
    top = document.pop("", {})
    try:
        return Settings.from_dict({**document, **top})
    except SettingsError as exc:
        raise SpecError(str(exc), hint=exc.hint) from exc


def _settings(spec: Mapping[str, Any]) -> Settings:
    if not _get(spec, "model.source", ""):
        raise SpecError(
            "spec.model.source is required: the s3:// URI of the checkpoint prefix",
            hint="set spec.model.source, e.g. s3://models/flux-dev/",
        )
    settings = settings_from_spec(spec)
    try:
        return validate(settings)
    except SettingsError as exc:
        raise SpecError(str(exc), hint=exc.hint) from exc


def _get(spec: Mapping[str, Any], dotted: str, default: Any) -> Any:
    value: Any = spec
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return default
        value = value[part]
    return value


def _count_or_percent(value: Any) -> int | str:
    """PodDisruptionBudget's int-or-string: "25%" stays a string, "1" becomes the count 1."""
    text = str(value)
    return int(text) if text.isdigit() else text


def _int(spec: Mapping[str, Any], dotted: str, default: int, *, minimum: int) -> int:
    value = _get(spec, dotted, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"spec.{dotted}={value!r} must be an integer of at least {minimum}")
    return value
