"""`InstallationConfig`: what the platform decides for every DOD (the chart's values), one record.

A DOD author writes the spec; the platform team that installs the chart decides where on the
nodes a DOD may put files, which loader code may run with the node cache writable, and how much
of the node the cache may take. Those choices reach the operator as flags of `dlo operator run`
(the chart's Deployment passes them) and `dlo render` takes the same flags, so a render refuses
what the cluster would. `add_flags` declares the flags once for both commands and `from_args`
reads them into the record that `admission.admit` checks every DOD against. Pure; no cluster.
"""

from __future__ import annotations

import argparse
import enum
import re
from dataclasses import dataclass

from dlo_contract.deployment import DEFAULT_LOADER_UID, NetworkPolicyConfig
from dlo_operator.host_paths import (
    DEFAULT_ALLOWED_HOST_PATHS,
    DEFAULT_CACHE_PATH_PREFIX,
    cache_path_prefix_problem,
    normalized,
)
from dlo_operator.node_cache import DEFAULT_NODE_CACHE_ROOT
from dlo_operator.spec import DEFAULT_LOADER_IMAGE



class LoaderImageUpdate(str, enum.Enum):
    """When the pods of a DOD that names no loader image take a new default loader image."""

    ON_SPEC_CHANGE = "OnSpecChange"
    """With the next change of the DOD's pod template (the pods restart then anyway): pods keep
    the loader image their StatefulSet holds, so an operator upgrade restarts no pod."""
    ROLLING = "Rolling"
    """At once: the StatefulSet rolls its pods onto the new image."""


DEFAULT_LOADER_GID = DEFAULT_LOADER_UID
MAX_ID = 2**31 - 1
"""The largest id a pod's `runAsUser` may hold."""
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A namespace name (a DNS-1123 label)."""
_POLICY_DEFAULTS = NetworkPolicyConfig()


@dataclass(frozen=True, kw_only=True)
class InstallationConfig:
    """The platform's choices; each field names the chart value that sets it."""

    allowed_host_paths: tuple[str, ...] = DEFAULT_ALLOWED_HOST_PATHS
    """Node directories set aside for the node cache, which a DOD's own `spec.volumes` may not
    mount (`cache_directories`): chart value `allowedHostPaths`, flag `--allowed-host-path`."""
    loader_image: str = DEFAULT_LOADER_IMAGE
    """Loader image of a DOD that names none: chart value `loaderImage`, flag `--loader-image`."""
    loader_image_update: LoaderImageUpdate = LoaderImageUpdate.ON_SPEC_CHANGE
    """When running pods take a new `loader_image` (`loader_image.kept_image`): chart value
    `loaderImageUpdate`, flag `--loader-image-update`; a DOD's annotation
    `dlo.dev/loader-image-update` overrides it."""
    allowed_loader_images: tuple[str, ...] = ()
    """Further images `spec.loader.image` may name, compared as whole references (the loader
    writes the node cache, so this is code the platform trusts): chart value
    `allowedLoaderImages`, flag `--allowed-loader-image`. `loader_image` is always allowed."""
    allowed_user_host_paths: tuple[str, ...] = ()
    """Node directories a DOD's own `spec.volumes` may mount as hostPath: chart value
    `allowedUserHostPaths`, flag `--allowed-user-host-path`. Empty (the default): none."""
    node_cache_max_bytes: int = 0
    """Bytes all entries of a node cache may take (0: no limit): chart value
    `nodeCache.maxBytes`, flag `--node-cache-max-bytes`. Only this evicts other DODs' entries."""
    node_cache_min_free_bytes: int = 0
    """Free bytes kept on the cache filesystem (0: no floor): chart value
    `nodeCache.minFreeBytes`, flag `--node-cache-min-free-bytes`."""
    cache_path_prefix: str = DEFAULT_CACHE_PATH_PREFIX
    """Directory in the containers under which a DOD's `cache.hostPath` and
    `offload.runtimeCacheRoot` must lie (`host_paths.cache_path_problems`): chart value
    `cachePathPrefix`, flag `--cache-path-prefix`."""
    node_cache_root: str = DEFAULT_NODE_CACHE_ROOT
    """Node directory holding each namespace's cache, `<root>/namespaces/<namespace>`, which the
    operator's PersistentVolumes serve (`node_cache`): chart value `nodeCache.hostPath`, flag
    `--node-cache-root`."""
    node_cache_uid: int = DEFAULT_LOADER_UID
    """User the loader runs as and the node agent gives each namespace's `cache/` to: chart
    value `nodeCache.uid`, flag `--node-cache-uid` (the loader image's user by default)."""
    node_cache_gid: int = DEFAULT_LOADER_GID
    """The loader's group, owner group of each `cache/`: chart value `nodeCache.gid`, flag
    `--node-cache-gid`."""

    network_policy: NetworkPolicyConfig = _POLICY_DEFAULTS
    """The NetworkPolicy of every DOD (`network_policy`): chart values `networkPolicy.enabled`
    and `networkPolicy.scrapeNamespaces` and the release namespace, flags `--network-policy`,
    `--scrape-namespace` and `--operator-namespace`."""

    @property
    def cache_directories(self) -> tuple[tuple[str, str], ...]:
        """The node directories of the node cache, each with the chart value that sets it: a
        DOD's own volumes may not reach into them."""
        return (*((path, "allowedHostPaths") for path in self.allowed_host_paths),
                (self.node_cache_root, "nodeCache.hostPath"))

    @property
    def loader_images(self) -> tuple[str, ...]:
        """Every image `spec.loader.image` may name."""
        return tuple(dict.fromkeys((self.loader_image, *self.allowed_loader_images)))


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The installation's flags, shared by `dlo operator run` and `dlo render`."""
    parser.add_argument("--allowed-host-path", action="append", default=[], metavar="DIR",
                        dest="allowed_host_paths",
                        help="a node directory set aside for the node cache, which a DOD's "
                        "own hostPath volumes may not overlap (repeatable; default "
                        f"{', '.join(DEFAULT_ALLOWED_HOST_PATHS)})")
    parser.add_argument("--loader-image", default=DEFAULT_LOADER_IMAGE, metavar="IMAGE",
                        help="loader image of DODs that name none in spec.loader.image "
                        f"(default {DEFAULT_LOADER_IMAGE})")
    parser.add_argument("--loader-image-update", type=LoaderImageUpdate,
                        default=LoaderImageUpdate.ON_SPEC_CHANGE,
                        choices=list(LoaderImageUpdate), metavar="POLICY",
                        help="when running pods of DODs that name no loader image take a new "
                        "--loader-image: OnSpecChange (with the next change of their pod "
                        "template; the default) or Rolling (at once)")
    parser.add_argument("--allowed-loader-image", action="append", default=[], metavar="IMAGE",
                        dest="allowed_loader_images",
                        help="another image spec.loader.image may name, as a whole reference "
                        "(repeatable; default: only --loader-image)")
    parser.add_argument("--allowed-user-host-path", action="append", default=[], metavar="DIR",
                        dest="allowed_user_host_paths",
                        help="a node directory under which spec.volumes may mount a hostPath "
                        "(repeatable; default: none)")
    parser.add_argument("--node-cache-max-bytes", type=_bytes, default=0, metavar="BYTES",
                        help="bytes all entries of a node cache may take; a DOD may ask for "
                        "less in cache.maxBytes (default 0: no limit)")
    parser.add_argument("--node-cache-min-free-bytes", type=_bytes, default=0, metavar="BYTES",
                        help="free bytes to keep on the cache filesystem; a DOD may ask for "
                        "more in cache.minFreeBytes (default 0: no floor)")
    parser.add_argument("--cache-path-prefix", type=_cache_path_prefix,
                        default=DEFAULT_CACHE_PATH_PREFIX, metavar="DIR",
                        help="directory in the containers under which a DOD's cache.hostPath "
                        "and offload.runtimeCacheRoot must lie (default "
                        f"{DEFAULT_CACHE_PATH_PREFIX})")
    parser.add_argument("--node-cache-root", type=_directory, default=DEFAULT_NODE_CACHE_ROOT,
                        metavar="DIR", help="node directory holding each namespace's cache, "
                        f"DIR/namespaces/NAMESPACE (default {DEFAULT_NODE_CACHE_ROOT})")
    _add_network_flags(parser)
    add_owner_flags(parser)


def _add_network_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network-policy", action=argparse.BooleanOptionalAction,
                        default=_POLICY_DEFAULTS.enabled,
                        help="a NetworkPolicy per DOD: its loaders' ports take connections only "
                        "from its own pods, the metrics port also from the operator's and the "
                        "scrape namespaces (default on; off where the network plugin enforces "
                        "no NetworkPolicy)")
    parser.add_argument("--operator-namespace", type=_namespace,
                        default=_POLICY_DEFAULTS.operator_namespace, metavar="NAMESPACE",
                        help="the operator's namespace, whose pods read the loaders' metrics "
                        f"(default {_POLICY_DEFAULTS.operator_namespace})")
    parser.add_argument("--scrape-namespace", type=_namespace, action="append", default=[],
                        dest="scrape_namespaces", metavar="NAMESPACE",
                        help="a namespace whose pods may read the loaders' metrics port, where "
                        "Prometheus runs (repeatable; default: none beyond the operator's)")


def add_owner_flags(parser: argparse.ArgumentParser) -> None:
    """The loader's user and group: the operator runs the loader as them, the node agent gives
    each namespace's `cache/` to them, and the chart passes both the same `nodeCache` values."""
    parser.add_argument("--node-cache-uid", type=_id, default=DEFAULT_LOADER_UID, metavar="UID",
                        help="user the loader runs as, owner of each namespace's cache/ "
                        f"(default {DEFAULT_LOADER_UID}, the loader image's user)")
    parser.add_argument("--node-cache-gid", type=_id, default=DEFAULT_LOADER_GID, metavar="GID",
                        help=f"the loader's group (default {DEFAULT_LOADER_GID})")


def from_args(args: argparse.Namespace) -> InstallationConfig:
    return InstallationConfig(
        allowed_host_paths=tuple(args.allowed_host_paths) or DEFAULT_ALLOWED_HOST_PATHS,
        loader_image=args.loader_image,
        loader_image_update=args.loader_image_update,
        allowed_loader_images=tuple(args.allowed_loader_images),
        allowed_user_host_paths=tuple(args.allowed_user_host_paths),
        node_cache_max_bytes=args.node_cache_max_bytes,
        node_cache_min_free_bytes=args.node_cache_min_free_bytes,
        cache_path_prefix=args.cache_path_prefix,
        node_cache_root=args.node_cache_root,
        node_cache_uid=args.node_cache_uid,
        node_cache_gid=args.node_cache_gid,
        network_policy=NetworkPolicyConfig(
            enabled=args.network_policy, operator_namespace=args.operator_namespace,
            scrape_namespaces=tuple(args.scrape_namespaces)))


def node_cache_root(text: str) -> str:
    """`--node-cache-root`'s check, shared with `dlo node-agent run`."""
    return _directory(text)


def _cache_path_prefix(text: str) -> str:
    problem = cache_path_prefix_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _directory(text: str) -> str:
    if not normalized(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an absolute, normalized directory; pass one like "
            f"{DEFAULT_NODE_CACHE_ROOT} (no '.', '..', '//' or trailing '/')")
    return text


def _namespace(text: str) -> str:
    if not _NAMESPACE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name; pass a DNS label of at most 63 characters: "
            "lower-case letters, digits and '-', starting and ending with a letter or digit")
    return text


def _id(text: str) -> int:
    """A non-root user or group id: the loader passes Pod Security `restricted`."""
    value = int(text) if text.isdigit() else 0
    if not 0 < value <= MAX_ID:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a non-root user or group id; pass a whole number from 1 to "
            f"{MAX_ID} (the loader runs as non-root: Pod Security restricted)")
    return value


def byte_count(text: str) -> int:
    """A flag's byte count (`--node-cache-max-bytes`, the agent's `--namespace-quota-bytes`)."""
    return _bytes(text)


def _bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; pass a whole number of bytes, 0 or more")
    return value
