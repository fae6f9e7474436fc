"""`make_room_within`: the deployment's own asks on room for one entry, beside the node's limits.

Two sets of limits meet in a node cache the operator's pods share. The node's (`cache.node_limits`:
the platform's chart values `nodeCache.maxBytes` and `nodeCache.minFreeBytes`, which the operator
writes into every pod's settings) bound all entries, and only they evict entries, other
deployments' included. A deployment's own `cache.max_bytes` (a cap on its entry) and
`cache.min_free_bytes` (a higher free-space floor for its fill) are checked here without evicting
anything for them, so no deployment empties a node shared with other teams by asking for little
space. The node's limits are the publication's room (`claim` passes them in `RoomLimits`, named
by `node_names`), which evicts for them once, as it reserves; in a document written by hand the
two coincide (`node_limits` falls back to the document's own). Called by `fill`, as the
publication's `prepare`; it must not write entries.
"""

from __future__ import annotations

from dlo_contract.cache import CacheRoot, CacheSpaceError, make_room
from dlo_contract.cache.fsutil import free_bytes
from dlo_contract.field_names import Names
from dlo_contract.settings import CacheConfig

NODE_NAMES = {"cache.max_bytes": "nodeCache.maxBytes (chart value)",
              "cache.min_free_bytes": "nodeCache.minFreeBytes (chart value)"}
"""How eviction's messages name the node's limits when the platform set them."""


def make_room_within(root: CacheRoot, entry_id: str, *, incoming_bytes: int, cache: CacheConfig,
                     names: Names) -> list[str]:
    """Check what the deployment asks for itself, raising `CacheSpaceError` when the entry
    exceeds it. The node's limits are the publication's room (`RoomLimits` with `node_names`),
    which evicts for them; only a deployment floor above the node's evicts here first, to
    check that floor against the space eviction leaves. Returns the removed ids."""
    node_max, node_floor = cache.node_limits
    platform = cache.node_max_bytes is not None
    if platform and cache.max_bytes and incoming_bytes > cache.max_bytes:
        raise CacheSpaceError(
            f"cache entry {entry_id} needs {incoming_bytes} bytes, more than "
            f"{names('cache.max_bytes')}={cache.max_bytes} this deployment allows its own "
            "entry; nothing was evicted", needed_bytes=incoming_bytes,
            free_bytes=free_bytes(root.path) if root.path.exists() else 0,
            hint=f"raise {names('cache.max_bytes')} (at most the platform's nodeCache.maxBytes, "
                 f"{node_max or 'no limit'}; 0 takes it) or narrow {names('loader.include')}")
    if not (platform and cache.min_free_bytes > node_floor):
        return []  # the publication's room evicts within the node's limits (`node_names`)
    # The deployment's floor is checked against the free space eviction leaves.
    removed = make_room(root, entry_id, incoming_bytes=incoming_bytes, max_bytes=node_max,
                        min_free_bytes=node_floor, names=node_names(cache, names))
    free = free_bytes(root.entries)
    if free - incoming_bytes < cache.min_free_bytes:
        raise CacheSpaceError(
            f"cache entry {entry_id} ({incoming_bytes} bytes) would leave "
            f"{free - incoming_bytes} bytes free in {root.path}, less than "
            f"{names('cache.min_free_bytes')}={cache.min_free_bytes} this deployment asks "
            f"for; eviction keeps only the platform's floor (nodeCache.minFreeBytes="
            f"{node_floor})", needed_bytes=incoming_bytes + cache.min_free_bytes,
            free_bytes=free,
            hint=f"lower {names('cache.min_free_bytes')} (0 takes the platform's floor) or "
                 "ask the cluster administrator for more room on the node")
    return removed


def node_names(cache: CacheConfig, names: Names) -> Names:
    """How eviction's messages name the node's limits: the chart values where the platform set
    them, else as `names` does."""
    if cache.node_max_bytes is None:
        return names
    return lambda path: NODE_NAMES.get(path) or names(path)
