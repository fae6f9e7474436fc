"""The settings document: one typed JSON file read by the loader and the runtime.

The operator normalizes a `DiffusionOffloadDeployment` spec into this document and mounts it into
every container of the pod (path in `DLO_CONFIG`). Field names follow the DLO design
(`OffloadConfig` and its options). Each field is declared once with `setting(...)`: its default,
description, bounds, CR path (`crd`) and loader flag (`cli`); the CRD, the README reference and
the loader flags are generated from these declarations (`make generate`). The rules that reject
combinations live in `dlo_contract.validation`. Torch-, boto3-, kopf- and kubernetes-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from dlo_contract.names import CONFIG_ENV, DEFAULT_CACHE_ROOT, DEFAULT_CONFIG_PATH
from dlo_contract.schema import Section, SettingsError, describe, leaves, setting
from dlo_contract.source_uri import SOURCE_PATTERN

__all__ = [
    "CONFIG_ENV", "DEFAULT_CACHE_ROOT", "DEFAULT_CONFIG_PATH", "GIB", "MIB", "SCHEMA_VERSION",
    "CacheConfig", "LoaderConfig", "OffloadConfig", "ParallelConfig", "Settings", "SettingsError",
    "load_settings", "replace_path",
]

SCHEMA_VERSION = 1
MIB = 1 << 20
NORMALIZED_PATH = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"
"""An absolute path without `.`/`..` segments, `//` or a trailing `/` (and not `/` itself): what
`posixpath.normpath` leaves unchanged. The host paths of a DOD must be spelled this way."""
GIB = 1 << 30
STREAM_PIECE_BYTES = 2 * MIB
"""What a loader reading alone (no fill group) holds per reader instead of chunk buffers: each
chunk streams to disk a piece at a time (a multiple of the direct-write alignment, one huge
page)."""

LoaderMode = Literal["multi-reader", "single-reader", "independent"]
RendezvousFallback = Literal["independent", "fail"]
VerifyMode = Literal["sizes", "full"]
DistBackend = Literal["gloo", "nccl"]
Globs = Annotated[tuple[str, ...], Field(strict=False)]
"""JSON lists become tuples (the models are frozen)."""


class OffloadConfig(Section):
    """Distributed Layerwise Offload policy."""

    enabled: bool = setting(
        True, crd="offload.enabled",
        description="Stream DiT blocks through two device slots; false keeps the model resident.")
    use_allgather: bool = setting(
        True, crd="offload.useAllgather",
        description="Keep 1/G of each block per rank and rebuild it with AllGather over the DP "
        "(else SP) group. False streams whole rank-local blocks and forces the shard size to 1.")
    resident_layers: int = setting(
        0, crd="offload.residentLayers", minimum=0,
        description="Leading blocks kept on the device, never streamed (rank-local mode only).")
    enable_runtime_cache: bool = setting(
        False, crd="offload.enableRuntimeCache",
        description="Publish the ordinary loader's final DiT tensors as a node-cache entry and "
        "map them (no-AllGather only); off by default because it costs a hash pass per rank.")
    runtime_cache_root: str | None = setting(
        None, crd="offload.runtimeCacheRoot", pattern=f"^$|{NORMALIZED_PATH}",
        description="Directory of this deployment's runtime entries. Under the operator, the "
        "path in the inference container where its own directory of the namespace's node cache "
        "is mounted writable, apart from cache.hostPath (neither inside the other) and under the "
        "platform's prefix (chart value cachePathPrefix, default /var/lib/dlo); empty means "
        "/var/lib/dlo/runtime there, and cache.hostPath for a document run by hand.")
    runtime_cache_lock_timeout_s: float = setting(
        600.0, crd="offload.runtimeCacheLockTimeoutSeconds", above=0,
        description="Seconds to wait for another process publishing the same runtime entry; "
        "ten minutes covers hashing a large DiT on a busy node.")
    runtime_cache_pin_limit_gib: float = setting(
        0.0, crd="offload.runtimeCachePinLimitGiB", minimum=0,
        description="Per-process budget (GiB) for registering the runtime-cache mapping with the "
        "device runtime; 0 turns registration off and keeps the two bounded staging slots.")
    group_wait_timeout_s: float = setting(
        300.0, crd="offload.groupWaitTimeoutSeconds", above=0,
        description="Seconds a rank of the DLO AllGather group waits for the others at the "
        "check that starts each forward (and disable) before it fails naming the forward. DLO "
        "creates no process group: the server's group's own timeout (torch's default is 30 "
        "minutes) bounds the block AllGathers. Five minutes covers a slower first compile.")
    model_cpu_offload: bool = setting(
        False, crd="offload.modelCpuOffload",
        description="Model-level CPU offload; forced off while DLO is enabled.")
    layerwise_cpu_offload: bool = setting(
        False, crd="offload.layerwiseCpuOffload",
        description="Standard layerwise CPU offload; forced off while DLO is enabled.")


class ParallelConfig(Section):
    """The parallel topology the inference engine already runs; DLO never creates groups."""

    dp: int = setting(1, crd="parallel.dp", above=0,
                      description="Data-parallel size; the first choice for DLO weight sharding.")
    sp: int = setting(1, crd="parallel.sp", above=0,
                      description="Sequence-parallel size; the DLO sharding group when dp is 1.")
    tp: int = setting(1, crd="parallel.tp", above=0,
                      description="Tensor-parallel size; never used as the DLO group.")
    hsdp: bool = setting(False, crd="parallel.hsdp",
                         description="Hybrid-sharded data parallel (owns parameter sharding "
                         "itself).")
    cfg_parallel: int = setting(1, crd="parallel.cfgParallel", one_of=(1, 2),
                                description="Classifier-free-guidance parallel size (1 or 2).")
    pp: int = setting(1, crd="parallel.pp", above=0, description="Pipeline-parallel size.")
    ep: int = setting(1, crd="parallel.ep", above=0, description="Expert-parallel size.")


class LoaderConfig(Section):
    """How the init container streams the checkpoint from object storage into the node cache."""

    source: str = setting(
        "", crd="model.source", cli="--source", required=True, pattern=SOURCE_PATTERN,
        description="URI of the checkpoint prefix: s3://bucket/prefix/, file:///path/ (a share, "
        "model.share), gs://bucket/prefix/, az://account/container/prefix/ (or "
        "https://account.blob.core.windows.net/container/prefix/), https://host/path/ (a server "
        "with a listing file) or hf://org/repo[@revision]/ (the Hugging Face Hub).")
    include: Globs = setting(
        ("*.safetensors", "*.json"), crd="model.include", cli="--include", max_items=64,
        description="Glob patterns, relative to the prefix, of the objects to fetch.")
    endpoint_url: str | None = setting(
        None, crd="model.endpointUrl", cli="--endpoint-url",
        description="The store's endpoint URL, for an S3-compatible server, a GCS or Azure "
        "emulator or a Hub mirror; empty uses the scheme's default (the S3 SDK's for the region, "
        "storage.googleapis.com, https://<account>.blob.core.windows.net, huggingface.co).")
    region: str | None = setting(
        None, crd="model.region", cli="--region",
        description="S3 region; empty uses the SDK's default chain.")
    path_style: bool = setting(
        False, crd="model.pathStyle", cli="--path-style",
        description="Path-style addressing (endpoint/bucket/key), needed by most S3-compatible "
        "servers.")
    mode: LoaderMode = setting(
        "multi-reader", crd="loader.mode", cli="--mode",
        description="multi-reader, each loader reads about 1/N and peers exchange the rest; "
        "single-reader, rank 0 reads and the rest receive; independent, every node reads "
        "everything.")
    readers: int = setting(
        16, crd="loader.readers", cli="--readers", above=0,
        description="Concurrent ranged GETs per loader; 16 fills a 10+ Gbit/s link with 16 MiB "
        "chunks.")
    chunk_bytes: int = setting(
        16 * MIB, crd="loader.chunkBytes", cli="--chunk-bytes", above=0, int64=True,
        description="Unit of planning, fetching, hashing and exchange (bytes).")
    rendezvous_timeout_s: float = setting(
        300.0, crd="loader.rendezvousTimeoutSeconds", cli="--rendezvous-timeout", above=0,
        description="Seconds to wait for all loaders to join before onRendezvousTimeout applies.")
    on_rendezvous_timeout: RendezvousFallback = setting(
        "independent", crd="loader.onRendezvousTimeout", cli="--on-rendezvous-timeout",
        description="What to do when not all loaders joined in time: independent reads "
        "everything alone, fail exits non-zero.")
    memory_limit_bytes: int = setting(
        1 * GIB, crd="loader.memoryLimitBytes", above=0, int64=True,
        description="Upper bound on in-flight chunk buffers (fetch plus exchange) per loader "
        "(bytes); with N loaders it must hold 2N + 1 chunks, and 3N + 4 to keep two exchange "
        "rounds in flight (each chunk with one 4 KiB page more, for its round state). A loader "
        "reading alone holds no chunk buffer: it streams to disk through one "
        f"{STREAM_PIECE_BYTES // MIB} MiB piece per reader.")
    backend: DistBackend = setting(
        "gloo", crd="loader.backend",
        description="torch.distributed backend of the peer exchange; a DOD's loader is a "
        "CPU-only init container, so the operator accepts only gloo (nccl is for loaders run on "
        "GPU hosts outside Kubernetes).")
    max_retries: int = setting(
        8, crd="loader.maxRetries", above=0,
        description="Attempts per ranged GET on throttling, 5xx, resets and short bodies.")
    stall_timeout_s: float = setting(
        30.0, crd="loader.stallTimeoutSeconds", cli="--stall-timeout", above=0,
        description="Seconds without a byte after which a ranged GET is abandoned and asked "
        "again at once on a new connection.")
    peer_timeout_s: float = setting(
        10.0, crd="loader.peerTimeoutSeconds", cli="--peer-timeout", above=0,
        description="Seconds a loader of a fill group may send no heartbeat (it sends about one "
        "a second, on its own connection to the group's store) before the others take it for "
        "lost (killed, stopped, frozen or cut off), naming its rank, pod and node: lost once "
        "the process group forms, they finish the fill without it (loss after loss, while one "
        "is left); lost before, while the members take their nodes' publications, they stop. "
        "A wait on the group for a silent loader ends within it; a loader killed on a node that "
        "stays up is found at once (its port refuses connections).")
    timeout_s: float = setting(
        3600.0, crd="loader.timeoutSeconds", above=0,
        description="Whole-fill deadline in seconds; any rank past it fails every rank.")
    metrics_port: int = setting(
        9400, crd="loader.metricsPort", cli="--metrics-port", minimum=0, maximum=65535,
        description="Port of the loader's Prometheus /metrics endpoint (and, once the fill "
        "ended, of its summary at /summary); the operator reads live progress and the per-node "
        "fill figures from it; 0 turns it off, and the status then shows no figures for the "
        "pods' fills. A sidecar loader that published also serves its entry there to the "
        "loaders of the same DOD that refill their node from it (loader.peerServeBytesPerSecond).")
    peer_serve_bytes_per_second: int = setting(
        256 * MIB, crd="loader.peerServeBytesPerSecond", minimum=0,
        int64=True,
        description="Most bytes per second a sidecar loader that published serves of its entry, "
        "from disk, to the loaders of the same DOD refilling another node from it (all of them "
        "together), so that serving never takes its own pod's disk and network from it; 0 serves "
        "nothing, and a refilling node reads the store.")


class CacheConfig(Section):
    """The content-addressed cache; under the operator, one per namespace and node, shared by
    the namespace's pods on that node."""

    root: str = setting(
        DEFAULT_CACHE_ROOT, crd="cache.hostPath", cli="--cache-root", pattern=NORMALIZED_PATH,
        description="Directory of the cache (holds v1/): an absolute normalized path (no '.', "
        "'..', '//' or trailing '/'). Under the operator, the path in the containers where the "
        "namespace's node cache is mounted (writable by the loader, read-only for the server), "
        "under the platform's prefix (chart value cachePathPrefix, default /var/lib/dlo); the "
        "node directory is the platform's (chart value nodeCache.hostPath), never the DOD's.")
    max_bytes: int = setting(
        0, crd="cache.maxBytes", minimum=0, int64=True,
        description="Bytes this deployment's entry may take; 0 takes the node's limit. Under the "
        "operator it never evicts other entries (only the platform's limit, chart value "
        "nodeCache.maxBytes, does) and may not exceed that limit; a larger entry fails its fill. "
        "Without node limits (a loader run by hand) it bounds all entries (LRU eviction).")
    min_free_bytes: int = setting(
        0, crd="cache.minFreeBytes", minimum=0, int64=True,
        description="Free space (bytes) a fill must leave on the cache filesystem; 0 takes the "
        "node's floor. Under the operator eviction keeps only the platform's floor (chart value "
        "nodeCache.minFreeBytes); a deployment may ask for more, never less, and a fill that "
        "would leave less than it asks fails instead of evicting for it.")
    node_max_bytes: int | None = setting(
        None, crd=None, minimum=0,
        description="Bytes all entries of the node cache may take, written by the operator from "
        "the platform's nodeCache.maxBytes (0: no limit); eviction follows it. None (a document "
        "not rendered by the operator): cache.max_bytes is the node's limit.")
    node_min_free_bytes: int | None = setting(
        None, crd=None, minimum=0,
        description="Free space eviction keeps on the cache filesystem, written by the operator "
        "from the platform's nodeCache.minFreeBytes. None: cache.min_free_bytes is the node's.")
    verify: VerifyMode = setting(
        "sizes", crd="cache.verify",
        description="How readers check an entry, sizes (manifest and file sizes) or full "
        "(re-hash).")

    @property
    def node_limits(self) -> tuple[int, int]:
        """(bytes all entries may take, free space to keep) that eviction follows: the node's,
        where the operator wrote them, else this document's own (a loader run by hand is its
        node's platform)."""
        return (self.max_bytes if self.node_max_bytes is None else self.node_max_bytes,
                self.min_free_bytes if self.node_min_free_bytes is None
                else self.node_min_free_bytes)


class Settings(Section):
    """The whole document. `schema_version` lets a newer reader refuse an older writer."""

    schema_version: int = setting(
        SCHEMA_VERSION, crd=None, one_of=(SCHEMA_VERSION,),
        description="Version of this document's layout.")
    origin: str | None = setting(
        None, crd=None,
        description="The custom resource this document was rendered from "
        "(`DiffusionOffloadDeployment namespace/name`), written by the operator; errors then "
        "name the CR's fields as the user wrote them.")
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    quantization: str = setting(
        "none", crd="quantization", min_length=1,
        description="Online quantization: none, fp8_per_tensor or another method's name.")
    cache: CacheConfig = Field(default_factory=CacheConfig)

    @property
    def runtime_cache_root(self) -> str:
        return self.offload.runtime_cache_root or self.cache.root

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Settings:
        if not isinstance(data, dict):
            raise SettingsError(f"settings: expected an object, found {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SettingsError(describe(exc, cls, "settings")) from None

    @classmethod
    def from_json(cls, text: str) -> Settings:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"settings document is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


SETTING_PATHS = frozenset(leaf.path for leaf in leaves(Settings))


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Read the document from `path`, else `$DLO_CONFIG`, else the default mount path."""
    where = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    try:
        text = where.read_text()
    except OSError as exc:
        raise SettingsError(
            f"cannot read settings document {where}: {exc.strerror}",
            hint=f"pass --config FILE or set {CONFIG_ENV}",
        ) from exc
    return Settings.from_json(text)


def replace_path(settings: Settings, dotted: str, value: Any) -> Settings:
    """Return `settings` with one field (`loader.mode`, `quantization`, ...) replaced, checked
    like the document itself. Used for command-line overrides."""
    if dotted not in SETTING_PATHS:
        raise SettingsError(f"unknown settings field {dotted!r}")
    section, _, name = dotted.rpartition(".")
    data = settings.to_dict()
    (data[section] if section else data)[name] = value
    return Settings.from_dict(data)
