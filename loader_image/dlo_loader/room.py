"""`make_room_within`: room for one entry under the node's limits, then the deployment's own asks.

Two sets of limits meet in a node cache the operator's pods share. The node's (`cache.node_limits`:
the platform's chart values `nodeCache.maxBytes` and `nodeCache.minFreeBytes`, which the operator
writes into every pod's settings) bound all entries, and only they evict entries, other
deployments' included. A deployment's own `cache.max_bytes` (a cap on its entry) and
`cache.min_free_bytes` (a higher free-space floor for its fill) are checked here without evicting
anything for them, so no deployment empties a node shared with other teams by asking for little
space. In a document written by hand the two coincide (`node_limits` falls back to the document's
own), and this is plain `make_room`. Called by `fill` before every fill; it must not write entries.
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
    """Evict unused entries, least recently used first, until `entry_id` fits the node's
    limits; raise `CacheSpaceError` when it cannot, or when it exceeds what the deployment asks
    for itself. Returns the removed ids."""
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
    node_names = (lambda path: NODE_NAMES.get(path) or names(path)) if platform else names
    removed = make_room(root, entry_id, incoming_bytes=incoming_bytes, max_bytes=node_max,
                        min_free_bytes=node_floor, names=node_names)
    if platform and cache.min_free_bytes > node_floor:
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
