"""Names that cross planes: environment variables, mount paths and default ports.

The operator writes these into pods, the loader and the runtime read them; each is written here
once and imported by every side, so a rename cannot leave one plane behind. Pure constants.
"""

from __future__ import annotations

# --- the settings document ---------------------------------------------------------------------
CONFIG_ENV = "DLO_CONFIG"
"""Path of the settings document in every container of a pod."""
SETTINGS_MOUNT = "/etc/dlo"
SETTINGS_FILE = "settings.json"
DEFAULT_CONFIG_PATH = f"{SETTINGS_MOUNT}/{SETTINGS_FILE}"

# --- the entry document (loader -> main container) ---------------------------------------------
ENTRY_FILE_ENV = "DLO_ENTRY_FILE"
"""Path of the entry document the loader writes and the runtime reads."""
RUN_DIR = "/run/dlo"
"""A volume shared by the loader sidecar and the main container of one pod."""
DEFAULT_ENTRY_FILE = f"{RUN_DIR}/entry.json"
ENTRY_WAIT_ENV = "DLO_ENTRY_WAIT_SECONDS"
"""Seconds the main container waits for the entry document to appear. The operator sets it when
the loader is the pod's native sidecar, which fills while the main container starts; unset (or
0), an absent entry document means no loader runs for this process."""

# --- the fill summary (loader -> operator) ------------------------------------------------------
DEFAULT_SUMMARY_FILE = "/dev/termination-log"
"""Where the kubelet picks up the container's termination message."""
LOADER_SUMMARY_PATH = "/summary"
"""HTTP path, on the loader's metrics port, of its fill summary once the fill has ended (404
before): a sidecar loader stays up, so the operator reads the figures there."""
LOADER_PROOF_HEADER = "X-DLO-Fill-Proof"
"""HTTP header by which a reader of a loader's `LOADER_SUMMARY_PATH` shows it holds the DOD's fill
secret (`dlo_contract.fill_proof.summary_proof`): the summary names the entry, its source and the
group's pods and nodes, which no other namespace may read."""

# --- the node cache ------------------------------------------------------------------------------
DEFAULT_CACHE_ROOT = "/var/lib/dlo/cache"

# --- loader fill groups (torch.distributed's own names) -----------------------------------------
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
DEFAULT_RENDEZVOUS_PORT = 29500
"""The loaders' torch.distributed rendezvous port (torch's customary default)."""
FILL_GROUP_ENV = "DLO_FILL_GROUP"
"""The fill-group document (JSON, from the `<dod>-fill-group` ConfigMap) a loader joins."""
POD_NAME_ENV = "DLO_POD_NAME"
"""The loader's pod name (its key among the fill group's members)."""
NODE_NAME_ENV = "DLO_NODE_NAME"
"""The loader's node name (downward API `spec.nodeName`): how the other loaders of its fill group
name it when it is lost."""
REVISION_ENV = "DLO_REVISION"
"""The settings revision the pod was created for (a group of another revision is ignored)."""

# --- the DOD's fill secret (operator -> loader) ---------------------------------------------------
FILL_SECRET_ENV = "DLO_FILL_SECRET_FILE"
"""Path of the file that holds the DOD's fill secret: random bytes the operator writes into the
DOD's own Secret and mounts in its loaders only (never in a server). Every fill-group store key,
member record and peer-serving key is derived from it, so a process without it cannot join, read
or redirect the DOD's fill group. Unset: the loader runs without one (a group started by hand)."""
FILL_SECRET_MOUNT = "/run/dlo-fill-secret"
"""Directory the operator mounts the DOD's fill Secret at, in the loader container only."""
FILL_SECRET_KEY = "secret"
"""The key of the fill Secret's data (and so the file name under FILL_SECRET_MOUNT)."""
DEFAULT_FILL_SECRET_FILE = f"{FILL_SECRET_MOUNT}/{FILL_SECRET_KEY}"

# --- metrics (loader -> operator, Prometheus) -----------------------------------------------------
OPERATOR_METRICS_PORT = 8081
"""Default port of the operator's `/metrics` (`dlo operator run --metrics-port`, the chart's
`metrics.port`)."""
LOADER_METRICS_PORT_NAME = "loader-metrics"
"""Name of the loader container's `/metrics` port; the chart's PodMonitor selects it by name."""
PIPELINE_INDEX = "model_index.json"
"""The file of a diffusers checkpoint that names its pipeline class and components: what `dlo serve`
builds, and the folders a cache entry must hold for it."""
