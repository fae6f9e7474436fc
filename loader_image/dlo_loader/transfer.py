"""The data path of a fill once its node's publication is taken: the exchange started, run, its
bytes checked, and the entry committed.

Owns how a fill reads (from the store, streamed alone or chunk by chunk in a group, alone from
the peers that hold the entry first (`peer_reads`), or from this node's entry where it holds
one), the store's whole-object checksums asked for while the bytes
move, and the order of the last steps: exchange, headers and store checksums (`checks`), every
rank's digests compared, then (unless this node holds the entry already) the commit. A member
lost during the exchange or the comparison, the survivors go on (`survive`). Called by
`fill`. Must not take locks, join a group or decide the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo_loader import digest as digests_of
from dlo_loader.checks import Checked, agree, check_files, checked_files, compare, own_checks
from dlo_loader.errors import MemberLost
from dlo_loader.plan import Plan
from dlo_loader.progress import Progress
from dlo_loader.sources import Source
from dlo_contract.cache import FileRecord, Publication
from dlo_contract.field_names import Names
from dlo_contract.settings import LoaderConfig
from dlo_contract.units import human_bytes

if TYPE_CHECKING:  # exchange and transport are imported once the transfer starts
    import threading

    from dlo_loader.exchange import Exchange, Reader
    from dlo_loader.file_hashes import FollowingHashes
    from dlo_loader.peer_reads import PeerReads
    from dlo_loader.sink import FileSink
    from dlo_loader.members import Loss
    from dlo_loader.stream import Streamer
    from dlo_loader.survive import Survived
    from dlo_loader.group import Group

log = logging.getLogger(__name__)
PRODUCER = "dlo-loader"


class Transfer:
    """One fill's data path; `start` builds an exchange with its reads under way, `run` ends it."""

    def __init__(self, *, store: Source, progress: Progress, config: LoaderConfig,
                 rank: int, deadline: float, stop: threading.Event, source: str,
                 names: Names) -> None:
        self.store, self.progress, self.config = store, progress, config
        self.rank, self.deadline, self.stop = rank, deadline, stop
        self.source, self.names = source, names
        self.store_check: digests_of.StoreCheck | None = None
        self._hashes: FollowingHashes | None = None
        """Whole-file hashes followed while a fill alone writes the files (`file_hashes`)."""
        self._sink: FileSink | None = None
        """The files being written in the publication's tmp dir, made by the first exchange."""
        self.peers: PeerReads | None = None
        """A fill alone: the other nodes that hold the entry, read before the store."""
        self.survived: Survived | None = None
        """A group that lost a member mid-exchange and went on without it (`survive`): its
        survivors' group, what the loss cost."""
        self._first: Exchange | None = None
        """The exchange of the plan every member agreed on, once it ended."""

    def start(self, pub: Publication, plan: Plan, *, grouped: bool) -> Exchange:
        """The plan's data path, its reads started: from the store, or from this node's entry."""
        from dlo_loader.exchange import Exchange
        from dlo_loader.sink import EntryChunks, FileSink

        rank = self.rank if grouped else 0
        log.info("plan: %s over %d rank(s), %d chunks of at most %s; this rank reads %s%s",
                 plan.mode, plan.world_size, len(plan.chunks), human_bytes(plan.chunk_bytes),
                 human_bytes(plan.owned_bytes(rank)),
                 " from its cached entry" if pub.existing else "")
        if pub.existing is None and self._sink is None:  # one per publication
            assert pub.tmp_dir is not None
            self._sink = FileSink(pub.tmp_dir, plan.files)
        sink = None if pub.existing is not None else self._sink
        read = (EntryChunks(pub.existing, plan.files, plan.algorithms).read if pub.existing
                else self._reader(plan))
        self.progress.start()
        self.progress.phase = "transferring"  # metrics: phase
        stream = None if pub.existing or grouped else self._following(
            self._streamer(plan), plan, pub.tmp_dir)  # alone: streamed
        return Exchange(plan, rank=self.rank, grouped=grouped, read=read, sink=sink,
                        progress=self.progress, config=self.config, deadline=self.deadline,
                        stop=self.stop, stream=stream, names=self.names)

    def run(self, pub: Publication, plan: Plan, group: Group | None,
            identity: dict[str, Any], exchange: Exchange | None) -> None:
        """Exchange (`exchange`: started before the group formed), check and (unless this node
        holds the entry already) commit."""
        # The store's whole-object checksums are asked for while the bytes move: a HEAD per large
        # object after the last byte would lengthen every fill by their round trips.
        beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-checksums")
        try:
            published = None if pub.existing is not None else beside.submit(
                self.store.checksums, checked_files(plan))
            digests = self._exchange(pub, plan, group, exchange)
            if self.survived is not None:
                group = self.survived.group
            self.progress.phase = "checking"  # metrics: phase
            checked = own_checks(digests, (lambda: None) if published is None else (
                lambda: self._check(pub.tmp_dir, plan, digests, published)))
            if published is None:
                self._compare(pub, plan, group, checked)
                return
            records, tensors = self._compare(pub, plan, group, checked)
        finally:  # a failed fill does not wait for a HEAD in flight
            beside.shutdown(wait=False, cancel_futures=True)
            if self._hashes is not None:
                self._hashes.close()
            if group is not None:
                self._log_buffers()
        pub.commit("checkpoint", identity, records, tensor_count=tensors, producer=PRODUCER)

    def _log_buffers(self) -> None:
        from dlo_loader.exchange_budget import BUFFERS

        name = self.names("loader.memory_limit_bytes")
        log.info("exchange: chunk buffers held at most %d bytes at once (%s=%d)", BUFFERS.peak,
                 name, self.config.memory_limit_bytes)

    def _exchange(self, pub: Publication, plan: Plan, group: Group | None,
                  exchange: Exchange | None) -> list[str]:
        """Agree on the plan, run the exchange, and end it whatever happens."""
        try:
            if exchange is None:
                exchange = self.start(pub, plan, grouped=group is not None)
            try:
                if group is not None:
                    agree(group, plan.fingerprint)
                return exchange.run(group)
            except MemberLost:
                loss = group.watch.lost() if group is not None else None
                if loss is None:
                    raise
            assert group is not None
            self.survived = self._go_on(plan, group, loss, exchange, pub)
            return self.survived.digests
        finally:
            if exchange is not None:
                exchange.abandon()
            self._first = exchange
            self.progress.stop()

    def _compare(self, pub: Publication, plan: Plan, group: Group | None,
                 checked: Checked) -> Any:
        """Every rank's checks compared (`checks.compare`). A member lost meanwhile leaves every
        survivor with every chunk written (each one's exchange ended with all of them ready):
        the survivors form their group (`survive`, nothing moves again) and compare there."""
        try:
            return compare(group, checked)
        except MemberLost:
            loss = group.watch.lost() if group is not None else None
            if loss is None or self._first is None:
                raise
        assert group is not None
        earlier, survived = self.survived, self._go_on(plan, group, loss, self._first, pub,
                                                       done=checked.digests)
        if earlier is not None:  # lost in the comparison of survivors: both losses count
            survived = replace(survived, without=earlier.without + survived.without,
                               read_again=earlier.read_again + survived.read_again)
        self.survived = survived
        return compare(survived.group, replace(checked, digests=survived.digests))

    def _go_on(self, plan: Plan, group: Group, loss: Loss, first: Exchange,
               pub: Publication, done: list[str] | None = None) -> Survived:
        """The exchange cut short by `loss`, finished by the survivors (`survive`): this rank's
        chunks lie in its tmp dir, or in its node's entry where it holds one; `done`: every
        chunk's digest, where the loss came once the exchange was over."""
        from dlo_loader.exchange import Exchange
        from dlo_loader.survive import go_on

        self.stop.clear()  # an exchange that ended (the loss came after it) stopped the retries

        def exchange_of(again: Plan, rank: int, read: Reader) -> Exchange:
            return Exchange(again, rank=rank, grouped=True, read=read, sink=self._sink,
                            progress=self.progress, config=self.config,
                            deadline=self.deadline, stop=self.stop, names=self.names)

        directory = pub.existing or pub.tmp_dir
        assert directory is not None
        return go_on(plan=plan, group=group, loss=loss, first=first, tmp_dir=directory,
                     store_read=self._reader(plan), exchange_of=exchange_of,
                     whole=pub.existing is not None, done=done)

    def _check(self, directory: Path | None, plan: Plan, digests: list[str],
               published: Future[dict[str, digests_of.StoreChecksum]],
               ) -> tuple[list[FileRecord], int]:
        """Headers, then the store's checksums (`published`), then the manifest records."""
        checked = check_files(directory, plan, digests, self.source)
        assert directory is not None
        files = []
        for index, obj in enumerate(plan.files):
            chunks = [c for c in plan.chunks if c.file == index]
            files.append(digests_of.FileDigests(
                obj.key, plan.algorithms[index], [c.length for c in chunks],
                [digests[c.index] for c in chunks], plan.part_bytes[index]))
        by_key = {obj.key: obj for obj in plan.files}
        self.store_check = digests_of.check_store(
            files, published.result(), self.source,
            layout_holds=lambda key, part_bytes: self.store.layout_holds(by_key[key],
                                                                         part_bytes),
            hash_file=self._hash_file(plan, directory))
        log.info("store checksums: %d object(s) match the store's own (a CRC of the whole object "
                 "or of its parts, or a hash of the file), %d without one",
                 self.store_check.checked, self.store_check.unavailable)
        return checked

    def _following(self, stream: Streamer, plan: Plan, directory: Path | None) -> Streamer:
        """`stream`, each piece it delivers told to the hashes of the files whose listed store
        checksum is a whole-file hash (`file_hashes`), which read them back meanwhile."""
        listed = self.store.listed_checksums
        wanted = {index: (directory / obj.key, listed[obj.key].algorithm)
                  for index, obj in enumerate(plan.files)
                  if directory is not None and obj.key in listed
                  and listed[obj.key].value is not None
                  and listed[obj.key].algorithm in digests_of.FILE_HASHES}
        if not wanted:
            return stream
        from dlo_loader.file_hashes import FollowingHashes

        hashes = self._hashes = FollowingHashes(wanted, [obj.size for obj in plan.files])

        def followed(file: int, offset: int, length: int, pieces: Iterator[memoryview],
                     deliver: Callable[[int, memoryview], None]) -> int:
            def written(at: int, view: memoryview) -> None:
                deliver(at, view)
                hashes.written(file, offset + at, len(view))

            return stream(file, offset, length, pieces, written)

        return followed

    def _hash_file(self, plan: Plan, directory: Path) -> Callable[[str, str], str]:
        """`hash_file` of the store check: as followed while written, else from the file."""
        index = {obj.key: number for number, obj in enumerate(plan.files)}

        def hash_file(key: str, algorithm: str) -> str:
            followed = (self._hashes.hash_of(index[key], algorithm)
                        if self._hashes is not None else None)
            return followed or digests_of.file_hash(directory / key, algorithm)

        return hash_file

    def _streamer(self, plan: Plan) -> Streamer:
        def stream(file: int, offset: int, length: int, pieces: Iterator[memoryview],
                   deliver: Callable[[int, memoryview], None]) -> int:
            def counted(at: int, view: memoryview) -> None:
                self.progress.add(from_store=len(view))
                deliver(at, view)

            return self.store.stream(plan.files[file], offset, length, pieces, counted,
                                     plan.algorithms[file])

        return stream if self.peers is None else self.peers.streamer(plan, stream)

    def _reader(self, plan: Plan) -> Reader:
        def read(file: int, offset: int, into: memoryview) -> int:
            crc = self.store.read(plan.files[file], offset, into, plan.algorithms[file])
            self.progress.add(from_store=len(into))
            return crc

        return read
