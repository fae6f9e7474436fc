"""Which of the fill group's members went silent or died: a heartbeat beside the group.

Owns `PeerWatch` ([Note: heartbeat]), which names the members and losses of `members`:
`transport` starts one as a loader joins its group's store and runs every blocking store call
and collective through `PeerWatch.call`, which waits only while no member is lost; a lost member
fails the wait within `loader.peer_timeout_s`, naming it. Must not run collectives itself, read
the object store or write the cache.

[Note: heartbeat] gloo tells a survivor that a peer died (its sockets close) but not which one,
and a stopped peer (SIGSTOP, a frozen node) keeps its sockets open, so a collective would wait
for it until gloo's timeout. So every member's watch thread, on its own connection to the
group's store (rank 0 hosts it; in a group of survivors, rank 0 is the lowest rank left:
see `regroup`), adds one to its own beat counter about once a second and reads
the others'. A member whose counter has not moved for `peer_timeout_s` is lost; so is rank 0
when the store has not answered for that long (with its host stopped a call to it hangs; with
its host dead it fails at once). A member that ends posts that it left, and why: a loader that
finished is no loss, one that failed (or was terminated) is named with its reason. The first
member that finds a loss posts its verdict and the others adopt it, so every survivor names the
same member; rank 0, whose store carries the verdicts, keeps it up after a failure until every
member has left or is lost (at most `peer_timeout_s`). Blocking calls run on one worker thread,
in order, while the caller polls: after a loss that thread may never return, so it is a daemon
and the group is never torn down (`Group.close`); the process ends without waiting for it.

[Note: a closed connection] A member killed (SIGKILL, OOM) on a node that stays up need not be
waited for: once a collective failed because a peer's sockets closed, the watch asks, on its
next round (at once), whether each member's process is still there: every member listens on
its store's port (see `group_stores`), and a port that refuses a connection means the process
that held it is gone, so that member is lost now, not after `peer_timeout_s`. A stopped member
(its kernel still accepts) or a lost node (no answer) is left to the heartbeat. A member that
posted that it left is never taken for lost this way: the round reads the posts after the
probe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
import queue
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from dlo_loader.errors import GroupError
from dlo_loader.members import Loss, Member
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.1
"""How often a caller waiting on a blocking call asks the watch whether a member is lost."""
BEATS_PER_TIMEOUT = 8
"""Beats a member sends within `peer_timeout_s` (at most one a second): one late beat is no
loss."""
_BEAT = "dlo/beat"
_LEFT = "dlo/left"
_LOST = "dlo/lost"


def interruptible(call: Callable[[], T]) -> T:
    """`call()` on a thread of its own, waited for in this one, so that a signal's handler
    (SIGTERM: see `termination`) runs here while `call` blocks in C++ (torch's store client
    retries through interrupted system calls)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            future.set_exception(exc)

    threading.Thread(target=run, name="dlo-blocking-call", daemon=True).start()
    while True:
        with contextlib.suppress(FutureTimeout):
            return future.result(timeout=POLL_S)


class PeerWatch:
    """The heartbeat of one member (see [Note: heartbeat]); `connect` opens a new connection to
    the group's store; `members` by rank."""

    def __init__(self, *, rank: int, members: list[Member], timeout_s: float,
                 connect: Callable[[], Any], names: Names = document_names,
                 gone: Callable[[int, float], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic, arrival_s: float = 0.0) -> None:
        self.rank, self.members, self.timeout_s = rank, members, timeout_s
        self._arrival_s = arrival_s
        """Seconds more a member that has not beaten yet is given: a group of survivors waits
        for those that notice the loss later (see [Note: regrouping] in `regroup`)."""
        self._arrived: set[int] = set()
        self._names, self._clock, self._connect = names, clock, connect
        self.interval_s = min(1.0, timeout_s / BEATS_PER_TIMEOUT)
        self._lock = threading.Condition()
        now = clock()
        self._counts: dict[int, int] = {}
        self._changed = {r: now for r in range(len(members)) if r != rank}
        """When each other member's beat count last moved, by this watch's clock."""
        self._answered = now
        """When the store last answered a round of beats."""
        self._asking: float | None = now
        """When the round of beats under way began (its connection's, first); None between
        rounds: a watch that is not asking (its process stopped while it slept) takes no
        silence of the store's for a loss."""
        self._store_error: str | None = None
        self._left: dict[int, dict[str, Any]] = {}
        self._verdict: Loss | None = None
        self._closed = False
        """A collective failed: a peer's sockets closed (a silent member then died)."""
        self._gone = gone
        """`gone(rank, timeout_s)`: whether member `rank`'s process is gone for certain (see
        [Note: a closed connection]); None: only the heartbeat tells."""
        self._refused: set[int] = set()
        """Members whose process was found gone after a collective failed."""
        self._posts: list[tuple[str, str]] = []
        self._posted = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = \
            queue.SimpleQueue()
        self._busy: Future[Any] | None = None
        for target, name in ((self._beat, "dlo-heartbeat"), (self._serve, "dlo-group-call")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def member(self, rank: int) -> Member:
        return self.members[rank] if 0 <= rank < len(self.members) else Member(rank)

    @property
    def names(self) -> Names:
        return self._names

    def connect(self) -> Any:
        """A new connection to the group's store."""
        return self._connect()

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` on the worker thread, waited for while every member is
        alive; raises the lost member's `GroupError` (or what `function` raised)."""
        loss = self.lost()
        if loss is not None:
            raise self.error(loss)
        future: Future[T] = Future()
        self._calls.put((future, lambda: function(*args, **kwargs)))
        self._busy = future
        while True:
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                loss = self.lost()
                if loss is not None:
                    raise self.error(loss) from None
            except BaseException:
                # The error's traceback holds this frame, and the future holds the error: a cycle
                # that kept a failed collective's buffers (`function`'s) alive until the cyclic
                # GC ran, counted in the next exchange's budget or not by chance.
                if self._busy is future:
                    self._busy = None
                future = None
                raise

    def error(self, loss: Loss) -> GroupError:
        """What this member raises for `loss` (see `Loss.error`)."""
        return loss.error(me=self.member(self.rank))

    @property
    def idle(self) -> bool:
        """No call is left running (a collective or store call cut short by a loss or a
        signal): the process group can be torn down without waiting for it."""
        return self._busy is None or self._busy.done()

    def wait_lost(self) -> Loss | None:
        """After a collective failed (a peer's sockets closed): the member that is lost, once
        the watch knows (within `peer_timeout_s`), else None."""
        with self._lock:
            self._closed = True
        self._wake.set()  # a round now: it asks who is gone (see [Note: a closed connection])
        until = self._clock() + self.timeout_s + 2 * self.interval_s
        while (loss := self.lost()) is None and self._clock() < until:
            with self._lock:
                self._lock.wait(POLL_S)
        return loss

    def lost(self) -> Loss | None:
        """The member this group lost, if any (decided once, then the same answer)."""
        with self._lock:
            if self._verdict is None:
                self._verdict = self._judge()
                if self._verdict is not None:
                    log.warning("%s %s", self._verdict.member, self._verdict.how)
                    self._post(_LOST, self._verdict.to_json())
            return self._verdict

    def leave(self, error: BaseException | None = None) -> None:
        """Tell the others this member ends (finished, or failed with `error`), waiting a
        moment for the post to go out; stop beating. Rank 0 after a failure keeps the store up
        until every other member has left or is lost (see [Note: heartbeat])."""
        if self._stop.is_set():
            return  # left already
        ok = error is None
        why = "" if ok else " ".join(str(error).split()) or type(error).__name__
        with self._lock:
            self._post(f"{_LEFT}/{self.rank}", json.dumps({"ok": ok, "why": why}))
            target = self._posted + len(self._posts)
            self._lock.wait_for(lambda: self._posted >= target or self._store_error is not None,
                                timeout=2 * self.interval_s + 1.0)
            if self.rank == 0 and not ok:
                self._lock.wait_for(self._others_gone, timeout=self.timeout_s)
        self._stop.set()
        self._wake.set()

    def _serve(self) -> None:
        """The worker thread: blocking calls, one at a time, in order (a daemon: one cut short
        by a loss may never return, and the process must not wait for it)."""
        while True:
            future, call = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)
            future = call = None  # nor holds the last call (its buffers) while idle

    def _post(self, key: str, value: str) -> None:
        self._posts.append((key, value))
        self._wake.set()

    def _others_gone(self) -> bool:
        now = self._clock()
        return all(r in self._left or now - changed > self.timeout_s
                   for r, changed in self._changed.items())

    def _judge(self) -> Loss | None:
        """Who is lost, from what the watch saw (called holding the lock)."""
        now, timeout = self._clock(), self.timeout_s
        # Silence is measured up to this watch's last round, not up to now: a watch that could
        # not look (its own process starved or stopped) takes no one for lost.
        stale = [r for r, changed in self._changed.items()
                 if r not in self._left and self._answered - changed > timeout + (
                     0.0 if r in self._arrived else self._arrival_s)]
        failed = [r for r, left in self._left.items() if not left["ok"]]
        if self.rank != 0 and self._store_error is not None:
            return Loss(self.member(0), "died: the group's store it hosts closed this loader's "
                                        "connection")
        if self.rank != 0 and self._asking is not None and now - self._asking > timeout:
            return Loss(self.member(0), f"stopped answering: the group's store it hosts has not "
                                        f"answered for {timeout:g} s "
                                        f"({self._names('loader.peer_timeout_s')}); it was "
                                        "stopped, frozen or cut off")
        bound = f"{timeout:g} s ({self._names('loader.peer_timeout_s')})"
        gone = sorted(r for r in self._refused if r not in self._left)
        if gone:
            return Loss(self.member(gone[0]), "died: its connections to the group closed and "
                                              "its process is gone (its port refuses "
                                              "connections)")
        if stale and self._closed:
            return Loss(self.member(stale[0]), f"died: its connections to the group closed and "
                                               f"it sent no heartbeat for {bound}")
        if stale:
            return Loss(self.member(stale[0]), f"sent no heartbeat for {bound}: it died, was "
                                               "stopped or is cut off")
        if failed:
            return Loss(self.member(failed[0]),
                        f"left the group: {self._left[failed[0]]['why'] or 'it failed'}")
        return None

    def _beat(self) -> None:
        """The watch thread: beat, read the others' beats, posts and verdict, until stopped."""
        try:
            store = self._connect()
            while True:
                self._round(store)
                if self._stop.is_set():
                    return
                self._wake.wait(self.interval_s)
                self._wake.clear()
        except Exception as exc:  # noqa: BLE001 (the store is gone: judged by `lost`)
            with self._lock:
                self._store_error = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                    type(exc).__name__
                self._lock.notify_all()
            log.debug("heartbeat ended: %s", self._store_error)

    def _round(self, store: Any) -> None:
        """One round trip of beats: post what is queued, beat, read everything."""
        with self._lock:
            posts, self._posts = self._posts, []
            self._asking = self._clock()
        for key, value in posts:
            store.set(key, value)
        size = len(self.members)
        store.add(f"{_BEAT}/{self.rank}", 1)
        refused = self._probe()  # before the posts are read: one that left is no loss
        counts = {r: store.add(f"{_BEAT}/{r}", 0) for r in self._changed}
        left = {r: json.loads(store.get(f"{_LEFT}/{r}")) for r in range(size)
                if r != self.rank and store.check([f"{_LEFT}/{r}"])}
        verdict = json.loads(store.get(_LOST)) if store.check([_LOST]) else None
        with self._lock:
            now = self._clock()
            self._posted += len(posts)
            self._answered, self._asking = now, None
            self._arrived.update(r for r, count in counts.items() if count)
            for r, count in counts.items():
                if self._counts.get(r) != count:
                    self._counts[r], self._changed[r] = count, now
            self._left.update(left)
            self._refused |= refused
            if verdict is not None and self._verdict is None:
                self._verdict = Loss(self.member(int(verdict["rank"])), str(verdict["how"]))
            self._lock.notify_all()

    def _probe(self) -> set[int]:
        """The members whose process is gone, asked only once a collective failed (see [Note:
        a closed connection])."""
        with self._lock:
            asking = [r for r in self._changed if r not in self._left and r not in self._refused]
            if self._gone is None or not self._closed:
                return set()
        return {r for r in asking if self._gone(r, self.interval_s)}
