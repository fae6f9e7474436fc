"""The checks a fill passes before it publishes: the plan agreed across the group, every
safetensors header, the manifest records, and every rank's chunk digests equal.

Owns the decisions that keep a bad byte out of an entry: `agree` (every rank listed the same
objects and built the same plan), `conclude` (each rank's own checks, `own_checks`, then every
rank's outcome and digests compared, `compare`, so no rank publishes unless all agree byte for
byte; where a member is lost meanwhile, the survivors compare them again: `transfer`),
`check_files` and `record` (headers read, manifest records built from the chunk digests).
Called by `transfer`.
Must not move bytes or commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo_loader import digest as digests_of
from dlo_loader.errors import GroupError, LoaderError
from dlo_loader.plan import Plan
from dlo_contract.cache import FileRecord, ObjectIdentity
from dlo_contract.errors import DloError

if TYPE_CHECKING:  # group imports torch: loaded only when a group is needed
    from dlo_loader.group import Group


def agree(group: Group, fingerprint: str) -> None:
    """Every rank must have listed the same objects and built the same plan."""
    fingerprints = group.all_gather_object(fingerprint)
    differing = [r for r, f in enumerate(fingerprints) if f != fingerprint]
    if differing:
        raise GroupError(
            f"loader ranks {differing} built a different transfer plan than rank {group.rank}",
            hint="every loader needs the same settings (source, include, mode, chunk_bytes) "
                 "and the source must not change during the fill",
        )


@dataclass(frozen=True)
class Checked:
    """This rank's own final checks: their value, or the error they raised, and the digests
    every rank's must equal (`compare`)."""

    value: Any
    error: DloError | None
    digests: list[str]

    def shared(self) -> dict[str, Any]:
        """What the other ranks learn of it."""
        return {"error": str(self.error)} if self.error is not None else {"digests": self.digests}


def own_checks(digests: list[str], check: Callable[[], Any]) -> Checked:
    """Run this rank's final checks (`check`), keeping the error they raise for `compare`."""
    try:
        return Checked(check(), None, digests)
    except DloError as exc:
        return Checked(None, exc, digests)


def compare(group: Group | None, checked: Checked) -> Any:
    """Learn every rank's outcome (with a group) and compare chunk digests, so no rank
    publishes unless all agree byte for byte; the checks' value, or their error."""
    gathered = (group.all_gather_object(checked.shared()) if group is not None
                else [checked.shared()])
    if checked.error is not None:
        raise checked.error
    digests = checked.digests
    for rank, other in enumerate(gathered):
        if "error" in other:
            raise GroupError(f"loader rank {rank} failed: {other['error']}",
                             hint=f"see the log of rank {rank}; nothing was published")
        if other["digests"] != digests:
            chunk = next(i for i, (a, b) in enumerate(zip(digests, other["digests"])) if a != b)
            raise GroupError(f"chunk {chunk} differs between this loader and rank {rank} "
                             "(corrupted in transfer or on disk)", hint="rerun the fill")
    return checked.value


def conclude(group: Group | None, digests: list[str], check: Callable[[], Any]) -> Any:
    """Run this rank's final checks, then (with a group) learn every rank's outcome and compare
    chunk digests (`own_checks`, then `compare`)."""
    return compare(group, own_checks(digests, check))


def require_every_chunk(digests: list[str]) -> None:
    """Every chunk of the plan has a digest: one that never reached this rank's files (a path
    that skipped it, in the group's exchange or a re-plan after a lost member) would publish the
    preallocated zeros under a manifest that never saw them."""
    missing = [index for index, digest in enumerate(digests) if not digest]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise LoaderError(f"{len(missing)} chunk(s) of the plan were never written on this "
                          f"node (chunks {shown}); nothing was published",
                          hint="rerun the fill; report it with the loader's log if it repeats")


def check_files(directory: Path | None, plan: Plan, digests: list[str],
                source: str) -> tuple[list[FileRecord], int]:
    """Validate every safetensors header; build the manifest records from the chunk digests
    (every chunk must have one: `require_every_chunk`)."""
    from dlo_contract.safetensors_header import read_header

    assert directory is not None
    require_every_chunk(digests)
    by_file: dict[int, list[str]] = {}
    for chunk in plan.chunks:
        by_file.setdefault(chunk.file, []).append(digests[chunk.index])
    tensors = 0
    records = []
    for index, obj in enumerate(plan.files):
        if obj.key.endswith(".safetensors"):
            tensors += len(read_header(directory / obj.key, source + obj.key).tensors)
        records.append(record(obj, plan.file_chunk_bytes[index], by_file.get(index, []),
                              plan.algorithms[index]))
    return records, tensors


def checked_files(plan: Plan) -> list[ObjectIdentity]:
    """The objects whose store checksum the fill compares: those of more than one chunk, or cut
    at their parts (a single chunk is compared across ranks only)."""
    return [obj for obj, cut, parts in zip(plan.files, plan.file_chunk_bytes, plan.part_bytes)
            if obj.size >= cut or parts is not None]


def record(obj: ObjectIdentity, chunk_bytes: int, chunk_digests: list[str],
           algorithm: str) -> FileRecord:
    """Small files carry one digest (their single chunk's); larger ones the chunk list."""
    if obj.size > chunk_bytes:
        return FileRecord(obj.key, obj.size, chunk_bytes=chunk_bytes,
                          chunk_digests=tuple(chunk_digests), algorithm=algorithm)
    single = chunk_digests[0] if chunk_digests else digests_of.chunk_digest(b"", algorithm)
    return FileRecord(obj.key, obj.size, digest=single, algorithm=algorithm)
