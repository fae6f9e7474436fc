"""`dlo cache gc [--max-bytes N] [--min-free-bytes N] [--incoming-bytes N] [--remove ID ...]`:
evict least recently used entries, optionally making room for an entry of N bytes about to be
written (what the loader does before every fill), and remove named entries (a damaged one that
errors tell a person to remove).

Owns the gc command: limits default to the settings document's node limits (the platform's,
`cache.node_max_bytes` and `cache.node_min_free_bytes`, in a document the operator rendered; else
`cache.max_bytes` and `cache.min_free_bytes`; 0 = no limit), removes the named entries, removes leftovers of dead
writers, evicts, prints what it removed, and exits 1 when a named entry could not be removed or
the limits still do not hold (everything left is in use). Called by the `dlo` entry point. Must
not remove an entry in use nor decide whether the limits hold (both rules live in `evict`).
"""

from __future__ import annotations

import argparse

from dlo_cli.cache_common import add_root_argument, resolve_root, settings_cache_config
from dlo_contract.cache.evict import evict, list_entries, over_limits, remove_entry
from dlo_contract.cache.layout import CacheRoot, is_entry_id
from dlo_contract.cache.fsutil import free_bytes


def _byte_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected bytes >= 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser)
    parser.add_argument(
        "--max-bytes", type=_byte_count, default=None, metavar="N",
        help="keep all entries within N bytes (default: the settings' node limit; 0: no limit)",
    )
    parser.add_argument(
        "--min-free-bytes", type=_byte_count, default=None, metavar="N",
        help="keep N bytes free on the cache filesystem (default: the settings' node floor; 0: "
        "none)",
    )
    parser.add_argument(
        "--incoming-bytes", type=_byte_count, default=0, metavar="N",
        help="count an entry of N bytes about to be written, as the loader does before a fill",
    )
    parser.add_argument(
        "--remove", action="append", type=_entry_id, default=[], metavar="ID",
        help="also remove this entry, whatever its last use, unless it is in use (repeatable)",
    )


def _entry_id(text: str) -> str:
    if not is_entry_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an entry id (the first column of "
                                          "`dlo cache ls`)")
    return text


def run(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    max_bytes, min_free = args.max_bytes, args.min_free_bytes
    if max_bytes is None or min_free is None:
        node_max, node_floor = settings_cache_config().node_limits
        max_bytes = node_max if max_bytes is None else max_bytes
        min_free = node_floor if min_free is None else min_free
    incoming = args.incoming_bytes
    refused = [entry for entry in args.remove if not _remove(root, entry)]
    removed = evict(root, max_bytes=max_bytes, min_free_bytes=min_free, incoming_bytes=incoming)
    for entry in removed:
        print(f"evicted {entry}")
    if not root.entries.is_dir():
        print(f"no cache at {root.path}")
        return 0
    infos = list_entries(root)  # one walk of the entries for the totals and the verdict
    total = sum(info.bytes for info in infos)
    free = free_bytes(root.entries)
    print(f"{len(removed)} evicted; {total} bytes in entries, {free} bytes free")
    if over_limits(root, total, max_bytes, min_free, incoming):  # the check evict stops at
        in_use = [info.entry_id for info in infos if info.in_use]
        print(
            f"limits not met (max {max_bytes} bytes, min free {min_free} bytes, incoming "
            f"{incoming} bytes): the entries left are in use ({', '.join(in_use) or 'none'}), "
            "or the space is taken outside the cache"
        )
        return 1
    return 1 if refused else 0


def _remove(root: CacheRoot, entry: str) -> bool:
    """Remove one named entry; False (said why) when it is absent or in use."""
    if entry not in root.entry_ids():
        print(f"no entry {entry} in {root.path}")
        return False
    if not remove_entry(root, entry):
        print(f"not removed: {entry} is in use (or being published); stop the pods that map it")
        return False
    print(f"removed {entry}")
    return True
