"""Handing a namespace's `cache/` tree to the loader's user, in bounded memory, trusting none of it.

[Note: hand-over] When a `cache/` changes hands (written by an older, root loader; before
`nodeCache.uid` changed; or taken back by a root pod of the namespace, which Pod Security
`baseline` allows and which can mount the namespace's claim), everything below it is given to the
loader's user, or the loader could neither evict nor replace it. A tenant wrote this tree, so:
- memory is bounded: the walk streams each directory (`os.scandir` over a descriptor reads the
  kernel's listing a buffer at a time, never a list of names) and holds one open directory per
  level, at most `MAX_DEPTH` levels (the cache format nests a few; deeper ones are left and
  counted), so a million files in one directory cost what ten do;
- only regular files and directories change hands. Each name is opened without following a
  link (a directory with O_NOFOLLOW, anything else with O_PATH|O_NOFOLLOW, which opens a device
  or a fifo without touching it) and judged by the descriptor's own `fstat`, so a name swapped
  after the listing is never followed. A device node, fifo or socket is removed (the cache holds
  files and directories only, [Note: publication order] in the cache format); a symlink is left
  as it is, never followed nor given; a regular file with more than one link is left (it may be
  a file outside the cache);
- set-user-ID and set-group-ID bits are cleared on everything given (chown clears them on an
  executable file only, and set-group-ID without group execute survives it).
The agent holds CAP_CHOWN alone: a mode is changed only on what it owns, so a file of another
user is taken back (chown to 0) before its mode is corrected. A regular file's O_PATH descriptor
is changed through `/proc/self/fd/<n>`, the inode it opened, never the name again. The counts
go into one log line per hand-over (`HandOver`), never a line per file. Called by
`node_directories`; pure apart from the filesystem.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

MAX_DEPTH = 32
"""Directory levels below `cache/` the hand-over enters (`v1/entries/<id>/<file>` is 4; a
checkpoint's own folders add a few)."""
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_SET_ID = stat.S_ISUID | stat.S_ISGID


@dataclass(frozen=True)
class Owner:
    """Who owns a namespace's `cache/`: the loader's user and group (chart `nodeCache.uid`,
    `nodeCache.gid`)."""

    uid: int
    gid: int


@dataclass
class HandOver:
    """What one hand-over did, for its log line."""

    given: int = 0
    links_left: int = 0
    specials_removed: int = 0
    set_id_cleared: int = 0
    too_deep: int = 0
    unreadable: int = 0


def give_tree(fd: int, owner: Owner) -> HandOver:
    """Give everything below the directory `fd` to `owner` as [Note: hand-over] says."""
    counts = HandOver()
    levels: list[tuple[int, Iterator[os.DirEntry[str]]]] = [(fd, os.scandir(fd))]
    try:
        while levels:
            directory, entries = levels[-1]
            entry = next(entries, None)
            if entry is None:
                _close(levels.pop(), fd)
                continue
            child = _give_entry(directory, entry, owner, counts, deeper=len(levels) < MAX_DEPTH)
            if child is not None:
                try:
                    levels.append((child, os.scandir(child)))
                except OSError:
                    os.close(child)
                    raise
    finally:
        while levels:  # an error (EIO) left levels open: no descriptor outlives the walk
            _close(levels.pop(), fd)
    return counts


def _close(level: tuple[int, Iterator[os.DirEntry[str]]], top: int) -> None:
    directory, entries = level
    entries.close()  # type: ignore[attr-defined]  (os.scandir's iterator)
    if directory != top:
        os.close(directory)


def _give_entry(directory: int, entry: os.DirEntry[str], owner: Owner, counts: HandOver, *,
                deeper: bool) -> int | None:
    """Give one name of `directory`; a descriptor of it when the walk enters it."""
    if entry.is_dir(follow_symlinks=False):
        try:
            child = os.open(entry.name, _OPEN_DIRECTORY, dir_fd=directory)
        except FileNotFoundError:  # removed since the listing
            return None
        except OSError:  # swapped for a link or a file since the listing: judged below
            return _give_other(directory, entry.name, owner, counts)
        _give_descriptor(child, f"/proc/self/fd/{child}", owner, counts)
        if deeper:
            return child
        counts.too_deep += 1
        os.close(child)
        return None
    return _give_other(directory, entry.name, owner, counts)


def _give_other(directory: int, name: str, owner: Owner, counts: HandOver) -> None:
    try:
        fd = os.open(name, _OPEN_PATH, dir_fd=directory)  # no open(2) of a device: O_PATH
    except FileNotFoundError:
        return None
    except OSError:
        counts.unreadable += 1
        return None
    try:
        info = os.fstat(fd)
        if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
            counts.links_left += 1
        elif stat.S_ISREG(info.st_mode):
            _give_descriptor(fd, f"/proc/self/fd/{fd}", owner, counts)
        elif not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=directory)  # a device node, fifo or socket: never the cache's
            counts.specials_removed += 1
    finally:
        os.close(fd)
    return None


def _give_descriptor(fd: int, path: str, owner: Owner, counts: HandOver) -> None:
    """Give the inode `fd` opened (reached through `path`, its /proc name) to `owner`, set-ID
    bits cleared; the agent changes a mode only on what it owns (no CAP_FOWNER)."""
    info = os.fstat(fd)
    if info.st_mode & _SET_ID:
        if info.st_uid != 0:
            os.chown(path, 0, 0)
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~_SET_ID)
        counts.set_id_cleared += 1
        info = os.fstat(fd)
    if (info.st_uid, info.st_gid) != (owner.uid, owner.gid):
        os.chown(path, owner.uid, owner.gid)
    counts.given += 1
