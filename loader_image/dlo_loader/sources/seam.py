"""The source seam: what the fill asks of every scheme's reader, and the reads they share.

Owns the `Source` protocol (see the package docstring for its contract), `SourceOptions` (what
every source is opened with, from the fill's settings), the include-glob match and the empty
listing's error every listing uses, and `RangedReads`, the base of a reader that answers a
range with a body (`read` and `stream` from one `_body`: exact lengths, running CRCs, a retry
asking only for the bytes not delivered yet). Makes no call to any store itself.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ContextManager, Protocol

from dlo_loader import digest
from dlo_loader.digest import StoreChecksum
from dlo_loader.errors import SourceChanged, SourceError
from dlo_loader.source_retry import Retrier, ShortBody
from dlo_contract.cache import ObjectIdentity
from dlo_contract.field_names import Names, document_names
from dlo_contract.settings import LoaderConfig
from dlo_contract.source_uri import SourceAddress


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """What every source is opened with; a scheme uses what applies to it."""

    endpoint_url: str | None = None
    """The store's endpoint (S3-compatible server, emulator, Hub mirror); None: the scheme's
    public one."""
    region: str | None = None
    path_style: bool = False
    readers: int = 16
    """Reads at once: a reader keeps this many connections, plus one for its checksum calls."""
    attempts: int = 8
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when the fill ends early: retries stop waiting."""
    stall_timeout_s: float = 30.0
    """A body that sends no byte for this long is abandoned (`source_retry.Stalled`)."""
    on_stall: Callable[[str], None] = lambda what: None
    names: Names = document_names

    @classmethod
    def of(cls, loader: LoaderConfig, *, stop: threading.Event,
           on_stall: Callable[[str], None], names: Names) -> SourceOptions:
        """The options of a fill with these loader settings."""
        return cls(endpoint_url=loader.endpoint_url, region=loader.region,
                   path_style=loader.path_style, readers=loader.readers,
                   attempts=loader.max_retries, stop=stop,
                   stall_timeout_s=loader.stall_timeout_s, on_stall=on_stall, names=names)

    def retrier(self, source: SourceAddress, *, credentials: str) -> Retrier:
        """The retry policy of one source's calls; `credentials`: the hint of an access
        denied, saying where the scheme's credentials come from (never their values). A
        source read at its scheme's own address (no endpoint set) names the source URI when
        it cannot be reached, not an endpoint setting that was never set."""
        address = "loader.endpoint_url" if self.endpoint_url else "loader.source"
        return Retrier(str(source), attempts=self.attempts, stop=self.stop,
                       on_stall=self.on_stall, names=self.names, credentials=credentials,
                       address=address)


class Source(Protocol):
    """One opened source (see the package docstring for each member's contract)."""

    uri: SourceAddress
    retry: Retrier

    @property
    def chunk_algorithms(self) -> Mapping[str, str]: ...

    @property
    def part_bytes(self) -> Mapping[str, int]: ...

    @property
    def listed_checksums(self) -> Mapping[str, StoreChecksum]: ...

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]: ...

    def checksums(self, files: Sequence[ObjectIdentity]) -> dict[str, StoreChecksum]: ...

    def layout_holds(self, obj: ObjectIdentity, part_bytes: int) -> bool: ...

    def read(self, obj: ObjectIdentity, start: int, into: memoryview, algorithm: str
             ) -> int: ...

    def stream(self, obj: ObjectIdentity, start: int, length: int,
               pieces: Iterator[memoryview], deliver: Callable[[int, memoryview], None],
               algorithm: str) -> int: ...

    def close(self) -> None: ...


def matches(key: str, include: Sequence[str]) -> bool:
    """Whether a key relative to the source matches one of the include globs (`*` also matches
    `/`); a folder marker (a key ending in `/`) never does."""
    return bool(key) and not key.endswith("/") and any(
        fnmatch.fnmatchcase(key, pattern) for pattern in include)


def nothing_matched(source: SourceAddress, include: Sequence[str], names: Names) -> SourceError:
    """The error of a listing in which no object matches the include globs."""
    return SourceError(
        f"no object under {source} matches {names('loader.include')}={list(include)}",
        hint=f"check {names('loader.source')} and {names('loader.include')}")


def source_changed(where: str, how: str, *, hint: str | None = None) -> SourceChanged:
    """The error of an object that is not the one listed (`how`: what differs)."""
    return SourceChanged(
        f"{where}: the file changed since it was listed ({how}); nothing was published",
        hint=hint or "do not overwrite a checkpoint while it is being loaded; rerun the fill")


def fill_hashed(readinto: Callable[[memoryview], int], into: memoryview, piece_bytes: int,
                algorithm: str, crc: int = 0) -> tuple[int, int]:
    """Read with `readinto` until `into` is full or it returns 0, at most `piece_bytes` at a
    time, each piece hashed as it lands (see [Note: hashing while reading] in `digest`): the
    bytes read, and the running CRC `crc` extended by them."""
    got = 0
    while got < len(into):
        count = readinto(into[got:got + piece_bytes])
        if not count:
            break
        crc = digest.extend(crc, into[got:got + count], algorithm)
        got += count
    return got, crc


class Body(Protocol):
    """One answer's bytes, read into the caller's buffers (`source_body.Body` is S3's)."""

    def fill(self, into: memoryview, algorithm: str, crc: int = 0) -> tuple[int, int]:
        """Read until `into` is full or the body ends: the bytes read, and the running CRC
        `crc` of `algorithm` extended by them (`digest.extend`)."""
        ...

    def finish(self) -> bool:
        """After the bytes asked for: True when more followed (a broken answer)."""
        ...


class RangedReads:
    """`read` and `stream` of a reader whose `_body(obj, start, length)` opens the checked body
    of one range (a context manager that closes it); `retry` and `uri` are the reader's."""

    retry: Retrier
    uri: SourceAddress

    def _body(self, obj: ObjectIdentity, start: int, length: int) -> ContextManager[Body]:
        raise NotImplementedError

    def read(self, obj: ObjectIdentity, start: int, into: memoryview, algorithm: str) -> int:
        """Fill `into` with bytes `[start, start+len(into))` of `obj`, exactly, and return their
        running CRC of `algorithm` (`digest.extend`), or raise after the retries."""
        what = f"{self.uri}{obj.key} bytes {start}-{start + len(into) - 1}"
        return self.retry.run(what, lambda: self._get(obj, start, into, algorithm))

    def stream(self, obj: ObjectIdentity, start: int, length: int, pieces: Iterator[memoryview],
               deliver: Callable[[int, memoryview], None], algorithm: str) -> int:
        """Read bytes `[start, start+length)` of `obj` a piece at a time, each into the next of
        `pieces` cut to the bytes still to come, handing each piece to `deliver(offset, view)`
        (`offset` from `start`), and return the running CRC of `algorithm` of them all, or raise
        after the retries. A retry asks only for the bytes not delivered yet."""
        what = f"{self.uri}{obj.key} bytes {start}-{start + length - 1}"
        done = [0, 0]  # bytes delivered, their running CRC

        def attempt() -> int:
            while done[0] < length:
                at = start + done[0]
                with self._body(obj, at, length - done[0]) as body:
                    while done[0] < length:
                        view = next(pieces)[:length - done[0]]
                        got, crc = body.fill(view, algorithm, done[1])
                        if got < len(view):
                            raise ShortBody(f"got {done[0] + got} of {length} bytes")
                        deliver(done[0], view)
                        done[0], done[1] = done[0] + got, crc
                    if body.finish():
                        raise ShortBody(f"got {length}+ of {length} bytes")
            return done[1]

        return self.retry.run(what, attempt)

    def _get(self, obj: ObjectIdentity, start: int, into: memoryview, algorithm: str) -> int:
        length = len(into)
        with self._body(obj, start, length) as body:
            got, crc = body.fill(into, algorithm)
            extra = got == length and body.finish()
        if got != length or extra:
            raise ShortBody(f"got {got}{'+' if extra else ''} of {length} bytes")
        return crc


class ListedChecksums:
    """The members of a reader whose listing says all it knows (no parts, no extra calls):
    `checksums` answers from what `list` kept in `_listed` (every listed object's, so that
    small files are checked too); `layout_holds` is never asked (no part sizes)."""

    _listed: dict[str, StoreChecksum]
    _algorithms: dict[str, str]

    @property
    def chunk_algorithms(self) -> Mapping[str, str]:
        return self._algorithms

    @property
    def part_bytes(self) -> Mapping[str, int]:
        return {}

    @property
    def listed_checksums(self) -> Mapping[str, StoreChecksum]:
        return self._listed

    def checksums(self, files: Sequence[ObjectIdentity]) -> dict[str, StoreChecksum]:
        return dict(self._listed)

    def layout_holds(self, obj: ObjectIdentity, part_bytes: int) -> bool:
        return False
