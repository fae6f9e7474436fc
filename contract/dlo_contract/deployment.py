"""The CR-only part of a `DiffusionOffloadDeployment` spec: pods, images, resources, credentials.

`DeploymentSpec` is the whole spec, typed: the settings document (`dlo_contract.settings`) plus
the fields only the operator reads. Every field is declared once with `setting(...)` (CR path,
default, bounds, description); the CRD's `spec` schema is generated from `leaves(DeploymentSpec)`
(`dlo_contract.crd`), and the operator parses a CR with the same declarations
(`dlo_operator.spec`). Torch-, kopf- and kubernetes-free.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT
from dlo_contract.schema import Section, setting
from dlo_contract.settings import NORMALIZED_PATH, Settings
from dlo_contract.source_credentials import (
    AWS_ACCESS_KEY_ID_ENV,
    AWS_SECRET_ACCESS_KEY_ENV,
    AWS_SESSION_TOKEN_ENV,
    AZURE_ACCOUNT_KEY_ENV,
    AZURE_CONNECTION_STRING_ENV,
    AZURE_SAS_TOKEN_ENV,
    GCS_KEY_FILE,
    GOOGLE_APPLICATION_CREDENTIALS_ENV,
    HF_TOKEN_ENV,
    HTTPS_TOKEN_ENV,
)

DEFAULT_LOADER_IMAGE = "dlo-loader:0.1.0"
"""The loader image of a DOD that names none, unless the operator is given another
(`--loader-image`, the chart's `loaderImage`)."""
DEFAULT_LOADER_UID = 65532
"""The loader image's user and group (loader_image/Dockerfile): not root, so the loader passes
Pod Security `restricted`; the node agent gives each namespace's `cache/` to them."""
QUANTITY = r"^$|^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""A Kubernetes resource quantity such as `16Gi` (or empty)."""
DEFAULT_LOADER_RESOURCES: dict[str, Any] = {
    "requests": {"cpu": "1", "memory": "2Gi"},
    "limits": {"memory": "4Gi"},
}
"""Room for the loader's chunk buffers (`loader.memoryLimitBytes`, 1 GiB by default) plus torch."""

PullPolicy = Literal["Always", "IfNotPresent", "Never"]
Strings = Annotated[tuple[str, ...], Field(strict=False)]
Objects = Annotated[tuple[dict[str, Any], ...], Field(strict=False)]
"""Kubernetes core objects (EnvVar, ContainerPort, Toleration): kept as the user wrote them."""

CR_SECTIONS: dict[str, str] = {
    "": "The desired deployment. Fields mirror the DLO settings document.",
    "model": "Where the checkpoint lives: an object store, a file share, an HTTP(S) server or "
    "the Hugging Face Hub.",
    "model.credentials": "The source's credentials. With a Secret name, the loader receives the "
    "keys its source's scheme reads (each key below names one; the others are not passed), as "
    "secretKeyRef variables or, for gs://, a read-only key file. Without one, s3:// and gs:// "
    "use the pod's workload identity (serviceAccountName) or the node's, and az://, https:// "
    "and hf:// read anonymously (a public container, server or repository).",
    "model.share": "The file share of a file:/// source: one of spec.volumes (a "
    "persistentVolumeClaim of the DOD's namespace, an nfs volume, or a hostPath under the chart "
    "value allowedUserHostPaths), mounted read-only into the loader only.",
    "parallel": "The parallel topology the inference engine runs inside each pod. DLO never "
    "creates groups: it shards host weights over the DP group if dp > 1, else the SP group if "
    "sp > 1, never TP.",
    "offload": "Distributed Layerwise Offload policy.",
    "cache": "The node's content-addressed cache (hostPath), shared by every pod on the node.",
    "loader": "The loader sidecar that fills the node cache while the server starts.",
    "inference": "The inference server container; it imports dlo_runtime.",
    "disruptionBudget": "An optional PodDisruptionBudget over the pods, so that a node drain "
    "evicts a bounded number at once.",
}
"""Description of each object of the CR spec (by path under `spec`)."""


class CredentialsConfig(Section):
    """Where the loader's source credentials come from: a Secret's keys, each the variable of
    `dlo_contract.source_credentials` it becomes (its default key is that variable's name)."""

    secret_name: str = setting(
        "", crd="model.credentials.secretName",
        description="Secret in the DOD's namespace holding the keys; empty for none.")
    access_key_id_key: str = setting(
        AWS_ACCESS_KEY_ID_ENV, crd="model.credentials.accessKeyIdKey",
        description="s3://: key of the access key id in the Secret.")
    secret_access_key_key: str = setting(
        AWS_SECRET_ACCESS_KEY_ENV, crd="model.credentials.secretAccessKeyKey",
        description="s3://: key of the secret access key in the Secret.")
    session_token_key: str = setting(
        AWS_SESSION_TOKEN_ENV, crd="model.credentials.sessionTokenKey",
        description="s3://: key of the session token in the Secret, used only if present.")
    key_file_key: str = setting(
        "key.json", crd="model.credentials.keyFileKey",
        description="gs://: key of the service-account key file (JSON) in the Secret, mounted "
        f"read-only at {GCS_KEY_FILE} ({GOOGLE_APPLICATION_CREDENTIALS_ENV}).")
    connection_string_key: str = setting(
        AZURE_CONNECTION_STRING_ENV, crd="model.credentials.connectionStringKey",
        description="az://: key of a connection string in the Secret, used only if present.")
    account_key_key: str = setting(
        AZURE_ACCOUNT_KEY_ENV, crd="model.credentials.accountKeyKey",
        description="az://: key of the account's shared key in the Secret, used only if present.")
    sas_token_key: str = setting(
        AZURE_SAS_TOKEN_ENV, crd="model.credentials.sasTokenKey",
        description="az://: key of a SAS token in the Secret, used only if present.")
    bearer_token_key: str = setting(
        HTTPS_TOKEN_ENV, crd="model.credentials.bearerTokenKey",
        description="https://: key of the bearer token in the Secret.")
    hf_token_key: str = setting(
        HF_TOKEN_ENV, crd="model.credentials.hfTokenKey",
        description="hf://: key of the Hugging Face access token in the Secret.")


class ShareConfig(Section):
    """The file share a `file:///` source reads (mounted read-only into the loader)."""

    volume_name: str = setting(
        "", crd="model.share.volumeName",
        description="Name of the spec.volumes entry holding the checkpoint; required with a "
        "file:/// source, refused with any other.")
    mount_path: str = setting(
        "/models", crd="model.share.mountPath", pattern=NORMALIZED_PATH,
        description="Where the loader sees the share; the file:/// source's path lies under it "
        "(file:///models/flux-dev/ with the default).")


class LoaderPodConfig(Section):
    """The loader sidecar's image, rendezvous port and resources."""

    image: str = setting("", crd="loader.image",
                         description="Loader image (runs dlo cache fill); empty uses the "
                         "operator's default, the chart value loaderImage. Any other must be "
                         "one of the chart value allowedLoaderImages: the loader writes the "
                         "node cache.")
    image_pull_policy: PullPolicy = setting("IfNotPresent", crd="loader.imagePullPolicy",
                                            description="Pull policy of the loader image.")
    port: int = setting(DEFAULT_RENDEZVOUS_PORT, crd="loader.port", minimum=1, maximum=65535,
                        description="TCP port of the rendezvous on pod 0.")
    resources: dict[str, Any] = setting(
        lambda: dict(DEFAULT_LOADER_RESOURCES), crd="loader.resources",
        description="Resources of the loader container (core/v1 ResourceRequirements).")
    run_as_user: int = setting(DEFAULT_LOADER_UID, crd=None, minimum=1,
                               description="User the loader runs as: the platform's (chart "
                               "value nodeCache.uid), set by the operator, never by the CR.")
    run_as_group: int = setting(DEFAULT_LOADER_UID, crd=None, minimum=1,
                                description="The loader's group (chart value nodeCache.gid).")
    progress_deadline_s: float = setting(
        300.0, crd="loader.progressDeadlineSeconds", above=0,
        description="Seconds a prefill loader may go without progress (no byte written, no "
        "change of phase, as its metrics endpoint shows) before the operator reports the "
        "prefill as PrefillStuck, naming the node and what the loader waits for; the Job "
        "still runs until its deadline. Read by the operator only (not part of the settings "
        "revision, so changing it restarts no pod); needs loader.metricsPort.")


class InferenceConfig(Section):
    """The user's inference server container (it imports `dlo_runtime`)."""

    image: str = setting("", crd="inference.image", required=True, min_length=1,
                         description="Image of the inference server.")
    image_pull_policy: PullPolicy = setting("IfNotPresent", crd="inference.imagePullPolicy",
                                            description="Pull policy of the inference image.")
    command: Strings = setting((), crd="inference.command",
                               description="Entrypoint; empty keeps the image's.")
    args: Strings = setting((), crd="inference.args",
                            description="Arguments; empty keeps the image's.")
    env: Objects = setting((), crd="inference.env",
                           description="Extra environment (core/v1 EnvVar); the settings and "
                           "entry document variables are added.")
    resources: dict[str, Any] = setting(
        dict, crd="inference.resources",
        description="Resources (core/v1 ResourceRequirements); gpusPerPod is added to the limits.")
    ports: Objects = setting((), crd="inference.ports",
                             description="Container ports (core/v1 ContainerPort); a ClusterIP "
                             "Service named like the DOD exposes them, and the DOD's "
                             "NetworkPolicy admits any client to them: declare every port the "
                             "server listens on.")
    readiness_probe: dict[str, Any] = setting(
        dict, crd="inference.readinessProbe",
        description="Readiness probe (core/v1 Probe); empty means the pod is Ready once running.")
    startup_probe: dict[str, Any] = setting(
        dict, crd="inference.startupProbe",
        description="Startup probe (core/v1 Probe), holding off the liveness probe while the "
        "server maps the cache and warms up; empty for none.")
    liveness_probe: dict[str, Any] = setting(
        dict, crd="inference.livenessProbe",
        description="Liveness probe (core/v1 Probe); empty for none.")
    volume_mounts: Objects = setting(
        (), crd="inference.volumeMounts",
        description="Mounts of spec.volumes in the inference container (core/v1 VolumeMount); "
        "they may not overlap the cache or the operator's own mount paths.")


class DisruptionBudgetConfig(Section):
    """An optional PodDisruptionBudget over the workload pods (voluntary evictions, drains)."""

    enabled: bool = setting(
        False, crd="disruptionBudget.enabled",
        description="Create the PodDisruptionBudget (off, since a budget can block the drain of "
        "a one-replica DOD).")
    max_unavailable: str = setting(
        "1", crd="disruptionBudget.maxUnavailable", pattern="^([0-9]+|([0-9]|[1-9][0-9]|100)%)$",
        description="Pods a drain may evict at once, a count or a percentage from 0% to 100% "
        "such as 25%.")


DEFAULT_OPERATOR_NAMESPACE = "dlo-system"
"""Where `dlo render` assumes the operator runs (the chart passes its release namespace)."""


class NetworkPolicyConfig(Section):
    """The NetworkPolicy of each DOD's pods: the platform's choice (the chart's `networkPolicy`
    values, passed as flags of `dlo operator run` and `dlo render`), set by the operator, never
    by the CR."""

    enabled: bool = setting(
        True, crd=None,
        description="Render a NetworkPolicy per DOD (chart value networkPolicy.enabled): the "
        "loaders' ports take connections only from the DOD's own pods, and the metrics port "
        "also from the operator's namespace and scrapeNamespaces. Off only where the cluster's "
        "network plugin enforces no NetworkPolicy.")
    operator_namespace: str = setting(
        DEFAULT_OPERATOR_NAMESPACE, crd=None, min_length=1,
        description="The operator's namespace (the chart's release namespace), whose pods read "
        "the loaders' metrics and fill summaries.")
    scrape_namespaces: Strings = setting(
        (), crd=None,
        description="Further namespaces whose pods may read the loaders' metrics port: where "
        "the Prometheus that scrapes the chart's PodMonitor runs (chart value "
        "networkPolicy.scrapeNamespaces).")


class DeploymentSpec(Section):
    """The whole CR spec, typed: what the builders need."""

    replicas: int = setting(
        1, crd="replicas", above=0,
        description="Nodes to run on: one pod per node (required anti-affinity), each pod one "
        "inference engine that owns the node's GPUs. Also the number of loaders that share the "
        "object-store reads.")
    gpus_per_pod: int = setting(
        1, crd="gpusPerPod", minimum=0,
        description="GPUs requested by the inference container (nvidia.com/gpu); 0 requests none.")
    settings: Settings = Field(default_factory=Settings)
    credentials: CredentialsConfig = Field(default_factory=CredentialsConfig)
    share: ShareConfig = Field(default_factory=ShareConfig)
    loader: LoaderPodConfig = Field(default_factory=LoaderPodConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    service_account_name: str = setting(
        "", crd="serviceAccountName",
        description="Service account of the pods, the loader's workload identity for an s3:// "
        "or gs:// source without model.credentials.secretName (EKS IAM roles for service "
        "accounts or Pod Identity, GKE Workload Identity); empty uses the namespace default.")
    automount_service_account_token: bool = setting(
        False, crd="automountServiceAccountToken",
        description="Mount the service account's API token; the workload never needs it, so off.")
    node_selector: dict[str, str] = setting(dict, crd="nodeSelector",
                                            description="Node labels the pods must match.")
    tolerations: Objects = setting((), crd="tolerations",
                                   description="Tolerations of the pods (core/v1 Toleration).")
    affinity: dict[str, Any] = setting(
        dict, crd="affinity",
        description="Affinity of the pods (core/v1 Affinity); one-pod-per-node anti-affinity is "
        "added.")
    image_pull_secrets: Objects = setting(
        (), crd="imagePullSecrets",
        description="Secrets for pulling the loader and inference images from private "
        "registries (core/v1 LocalObjectReference, {name: ...}).")
    priority_class_name: str = setting(
        "", crd="priorityClassName",
        description="PriorityClass of the pods; empty uses the cluster default.")
    runtime_class_name: str = setting(
        "", crd="runtimeClassName",
        description="RuntimeClass of the pods (e.g. nvidia where the GPU runtime is not the "
        "default); empty uses the node default.")
    pod_labels: dict[str, str] = setting(
        dict, crd="podLabels",
        description="Extra labels on the pods; the operator's selector labels may not be set "
        "here.")
    pod_annotations: dict[str, str] = setting(dict, crd="podAnnotations",
                                              description="Extra annotations on the pods.")
    volumes: Objects = setting(
        (), crd="volumes",
        description="Extra pod volumes (core/v1 Volume), mounted through inference.volumeMounts "
        "(and model.share, in the loader); names may not reuse the operator's (settings, run, "
        "loader-tmp, cache, runtime-cache, dshm, source-credentials, fill-secret). A hostPath must lie under the chart value allowedUserHostPaths (default: none); "
        "gitRepo and flexVolume are refused.")
    shm_size: str = setting(
        "", crd="shmSize", pattern=QUANTITY,
        description="Size limit of the memory-backed /dev/shm of the inference container (torch "
        "and NCCL need more than the container runtime's 64 MiB with several ranks per pod); "
        "empty sets no limit beyond the pod's memory.")
    disruption_budget: DisruptionBudgetConfig = Field(default_factory=DisruptionBudgetConfig)
    network_policy: NetworkPolicyConfig = Field(default_factory=NetworkPolicyConfig)
