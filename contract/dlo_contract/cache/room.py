"""Room for a publication: whether its entry fits beside the entries and the publications in
progress, and the reservation that keeps it counted until it is published.

Owns `reserve` (decide, evict if asked, wait for publications in progress, write the reservation)
and `make_room` (one decision, no reservation: eviction as `dlo cache gc --incoming-bytes` would
do it, for tests and tools). Called by `publish.Publication` as the holder of the id's
`.publish` lock. Must not write entries or remove an entry in use (`evict` decides what may go).

[Note: room] Two publications of different entries into one root at once would each count only
the published entries and together break the limits. So a publication decides whether it fits
and writes its reservation under the root's room lock (`reservations/.lock`), counting every live
reservation: its whole size against the byte limit, what it has not allocated yet against the
free-space floor. The reservation goes once the entry is published (then the entry counts) or
the publication fails. A publication kept out by entries in use fails at once (only the end of
the pods that map them frees them), naming them and the publications in progress; one that
would fit but for the publications in progress waits for them (they may fail, or leave entries
nobody uses), saying every few seconds what it waits for, until its timeout, then fails the same
way. The room lock is held for one decision, never while waiting or writing. A publication
takes room only while it holds its id's `.publish` lock, and a fill group takes its nodes'
publications in one order (the loader's [Note: node order]), so waits for room close no cycle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dlo_contract.cache import locks
from dlo_contract.cache.entry import RootLike
from dlo_contract.cache.errors import CacheSpaceError
from dlo_contract.cache.evict import (
    EntryInfo,
    evict_listed,
    list_entries,
    over_limits,
    sweep_leftovers,
)
from dlo_contract.cache.fsutil import free_bytes
from dlo_contract.cache.layout import CacheRoot
from dlo_contract.cache.reservation import FillInProgress, Reservation, create, in_progress
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)
WAIT_LINE_INTERVAL_S = 5.0
"""How often a publication waiting for room says what it waits for."""
_POLL_S = 0.1
"""How often a waiting publication decides again: publications in progress end, and entries
fall out of use, without any event a process on another node's pod could be told of."""


@dataclass(frozen=True, kw_only=True)
class RoomLimits:
    """The limits a publication must keep and what it may do to keep them."""

    max_bytes: int = 0
    """Entries plus reservations stay within this (0: no limit)."""
    min_free_bytes: int = 0
    """At least this stays free once every reservation is written (0: no floor)."""
    evict: bool = False
    """Evict unused entries, least recently used first, to make room (the loader does)."""
    timeout_s: float = 0.0
    """How long to wait for publications in progress to leave room."""


@dataclass(frozen=True, kw_only=True)
class Shortfall:
    """Why an entry does not fit now: what takes the room."""

    entries_bytes: int
    in_use: tuple[EntryInfo, ...]
    others: tuple[FillInProgress, ...]
    free: int
    waiting_helps: bool
    """It would fit once the publications in progress are done and the entries that are not in
    use may go."""


def reserve(root: RootLike, entry_id: str, nonce_name: str, incoming_bytes: int,
            limits: RoomLimits, names: Names = document_names) -> tuple[Reservation, float]:
    """Reserve `incoming_bytes` for `entry_id` (`nonce_name`: the publication's tmp dir name),
    evicting and waiting as `limits` allow; returns the reservation and the seconds waited.
    Raises `CacheSpaceError` naming the entries in use and the publications in progress."""
    cache = CacheRoot.of(root)
    _refuse_oversized(cache, entry_id, incoming_bytes, limits, names)
    started = time.monotonic()
    next_line = started + WAIT_LINE_INTERVAL_S
    removed: list[str] = []
    decided = 0
    while True:
        now = time.monotonic()
        # One decision at a time per root: two deciders could both see the same room free.
        with locks.lock(cache.room_lock, timeout_s=max(started + limits.timeout_s - now, 1.0),
                        what="room"):
            evicted, shortfall = _decide(cache, entry_id, incoming_bytes, limits)
            if shortfall is None:  # waited: from the first decision to this one
                return (create(cache, entry_id, nonce_name, incoming_bytes),
                        now - started if decided else 0.0)
        decided += 1
        removed.extend(evicted)
        waited = time.monotonic() - started
        if not shortfall.waiting_helps or waited >= limits.timeout_s:
            raise _error(cache, entry_id, incoming_bytes, limits, shortfall, removed, waited,
                         names)
        if time.monotonic() >= next_line:
            next_line += WAIT_LINE_INTERVAL_S
            log.info("waiting %.0f s for room for cache entry %s (%d bytes) in %s: fills in "
                     "progress: %s; in use: %s; gives up after %.0f s", waited, entry_id,
                     incoming_bytes, cache.path, _listed(shortfall.others),
                     _listed(shortfall.in_use), limits.timeout_s)
        time.sleep(_POLL_S)


def make_room(root: RootLike, entry_id: str, *, incoming_bytes: int, max_bytes: int,
              min_free_bytes: int, names: Names = document_names) -> list[str]:
    """Evict until `entry_id` (`incoming_bytes`) fits beside the entries in use and the
    publications in progress; raise `CacheSpaceError` naming them where it cannot fit even
    once the publications in progress are done (where it can, `reserve` waits for them).
    Reserves nothing. Returns the removed ids."""
    cache = CacheRoot.of(root)
    limits = RoomLimits(max_bytes=max_bytes, min_free_bytes=min_free_bytes, evict=True)
    _refuse_oversized(cache, entry_id, incoming_bytes, limits, names)
    with locks.lock(cache.room_lock, timeout_s=60.0, what="room"):
        evicted, shortfall = _decide(cache, entry_id, incoming_bytes, limits)
    if shortfall is None or shortfall.waiting_helps:
        return evicted
    raise _error(cache, entry_id, incoming_bytes, limits, shortfall, evicted, 0.0, names)


def _decide(cache: CacheRoot, entry_id: str, incoming: int,
            limits: RoomLimits) -> tuple[list[str], Shortfall | None]:
    """As the room lock's holder: the entries evicted, and what keeps the entry out (None when
    it fits)."""
    cache.ensure()
    others = tuple(in_progress(cache))
    if limits.evict:
        sweep_leftovers(cache)
    listed = list_entries(cache)
    removed = (evict_listed(cache, listed, max_bytes=limits.max_bytes,
                            min_free_bytes=limits.min_free_bytes, keep=(entry_id,),
                            incoming_bytes=incoming, others=others)
               if limits.evict else [])
    if removed:
        log.info("evicted %d unused cache entries to make room for %s (%d bytes): %s",
                 len(removed), entry_id, incoming, ", ".join(removed))
    gone = {entry_id, *removed}
    infos = tuple(i for i in listed if i.entry_id not in gone)
    total = sum(info.bytes for info in infos)
    fits = not over_limits(cache, total, limits.max_bytes, limits.min_free_bytes, incoming,
                           others)
    if fits:
        return removed, None
    in_use = tuple(i for i in infos if i.in_use)
    held = sum(info.bytes for info in in_use)
    # Unused entries that stayed (being published or joined now) may go later, if this
    # publication evicts; one that does not can count only on the publications in progress.
    movable = total - held if limits.evict else 0
    free = free_bytes(cache.entries)
    return removed, Shortfall(entries_bytes=total, in_use=in_use, others=others, free=free,
                              waiting_helps=bool(others or movable) and _fits_later(
                                  total - movable, movable, free, incoming, limits))


def _fits_later(held: int, movable: int, free: int, incoming: int, limits: RoomLimits) -> bool:
    """Whether the entry would fit once the publications in progress are done and the entries
    that may go (`movable`: unused, but being published or joined right now) have gone: the
    others (`held`: in use, or not for this publication to evict) stay."""
    if limits.max_bytes > 0 and held + incoming > limits.max_bytes:
        return False
    if limits.min_free_bytes <= 0 and incoming <= 0:
        return True
    return free + movable - incoming >= limits.min_free_bytes


def _refuse_oversized(cache: CacheRoot, entry_id: str, incoming: int, limits: RoomLimits,
                      names: Names) -> None:
    if limits.max_bytes > 0 and incoming > limits.max_bytes:
        raise CacheSpaceError(
            f"cache entry {entry_id} needs {incoming} bytes, more than "
            f"{names('cache.max_bytes')}={limits.max_bytes} allows even in an empty cache",
            needed_bytes=incoming,
            free_bytes=free_bytes(cache.path) if cache.path.exists() else 0,
            hint=f"raise {names('cache.max_bytes')} (0 means no limit) or narrow "
                 f"{names('loader.include')}")


def _error(cache: CacheRoot, entry_id: str, incoming: int, limits: RoomLimits,
           shortfall: Shortfall, removed: list[str], waited: float,
           names: Names) -> CacheSpaceError:
    """What takes the room: entries in use, publications in progress, the floor."""
    others = shortfall.others
    reserved = sum(other.bytes for other in others)
    after = f" and waiting {waited:.0f} s" if waited >= 1 else ""
    if not limits.evict and limits.max_bytes <= 0:  # a writer that only checks free space
        needed = incoming + limits.min_free_bytes
        pending = (f"; fills in progress will still write "
                   f"{sum(other.unwritten for other in others)} bytes{after}: {_listed(others)}"
                   if others else "")
        return CacheSpaceError(
            f"not enough space for cache entry {entry_id}: needs {needed} bytes ({incoming} "
            f"for its files + {limits.min_free_bytes} free-space floor), {shortfall.free} "
            f"bytes free in {cache.path}{pending}", needed_bytes=needed,
            free_bytes=shortfall.free, hint=space_hint(cache))
    return CacheSpaceError(
        f"no room for cache entry {entry_id} ({incoming} bytes) in {cache.path}: "
        f"{shortfall.entries_bytes} bytes in entries and {reserved} bytes reserved by fills "
        f"in progress ({names('cache.max_bytes')}={limits.max_bytes}), {shortfall.free} bytes "
        f"free ({names('cache.min_free_bytes')}={limits.min_free_bytes}) after evicting "
        f"{len(removed)} unused entries{after}; in use: {_listed(shortfall.in_use)}; fills in "
        f"progress: {_listed(others)}",
        needed_bytes=incoming + max(limits.min_free_bytes, 0), free_bytes=shortfall.free,
        hint=_room_hint(shortfall, incoming, reserved, limits, names))


def _room_hint(shortfall: Shortfall, incoming: int, reserved: int, limits: RoomLimits,
               names: Names) -> str:
    """The fixes for what keeps the entry out, and only those: no pods to stop when no entry
    is in use, no byte limit to raise when there is none or it is not what binds."""
    fixes = ["stop the pods that map the entries in use"] if shortfall.in_use else []
    if limits.max_bytes > 0 and shortfall.entries_bytes + reserved + incoming > limits.max_bytes:
        fixes.append(f"raise {names('cache.max_bytes')}")
    if shortfall.free - incoming < max(limits.min_free_bytes, 0) or not fixes:
        floor = (f" or lower {names('cache.min_free_bytes')}" if limits.min_free_bytes > 0
                 else "")
        evicted = " with every unused entry evicted" if limits.evict else ""
        fixes.append(f"enlarge the volume (it has {shortfall.free} bytes free{evicted}; the "
                     f"entry needs {incoming}){floor}")
    hint = ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
    return hint + ("; or retry once the fills in progress are done" if shortfall.others else "")


def _listed(items: tuple[EntryInfo, ...] | tuple[FillInProgress, ...]) -> str:
    described = [item.describe() if isinstance(item, FillInProgress)
                 else f"{item.entry_id} ({item.bytes} bytes)" for item in items]
    return ", ".join(described) or "none"


def space_hint(cache: CacheRoot) -> str:
    return (f"free space with: dlo cache gc --root {cache.path} --max-bytes N, or enlarge the "
            "volume")
