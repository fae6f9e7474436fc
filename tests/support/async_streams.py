"""A CPU `StreamSet` whose copy and communication streams really run later, with a race detector.

The production CPU stand-in runs everything in program order, so no missing wait can fail a CPU
test. `AsyncStreamSet` models the CUDA semantics the backend relies on instead:
- Copies and AllGathers issued on the copy or communication stream are queued, one queue per
  stream, and run later: under `Schedule.LAZY` only when a wait or a synchronize needs them (a
  compute read without `ready` then sees stale bytes), under `Schedule.EAGER` as soon as the
  waits queued before them allow (a copy without `free` then overwrites a slot at once).
- Compute kernels and host copies run at once (their results are needed), in program order.
- Events carry vector clocks. `record` stamps the recording stream's clock when it runs,
  `wait_event` joins it into the waiting stream, `synchronize` joins it into the host; an op
  issued by the host also happens after every earlier host op. Nothing else orders two streams.
- Every access to a buffer that a queued op touches is logged with its agent and clock; two
  accesses to overlapping bytes, one a write, by agents with no happens-before edge between them
  raise `RaceError` naming both. So a missing wait fails even when the schedule happens to run
  things in a harmless order.

Use as a context (it installs a `TorchDispatchMode` that sees every aten op and collective):

    streams = AsyncStreamSet(Schedule.LAZY)
    with streams:
        backend = DistributedLayerwiseOffloadBackend(model, ..., device="cpu", streams=streams)
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dlo_runtime.streams import StreamSet

HOST, COMPUTE, COPY, COMM = "host", "compute", "copy", "comm"
Clock = dict[str, int]

_ALLGATHER = torch.ops.c10d._allgather_base_.default
_DEFERRABLE = {torch.ops.aten.copy_.default, _ALLGATHER}


class Schedule(enum.Enum):
    """When the queued streams run: as late or as early as the declared waits allow."""

    LAZY = "lazy"
    EAGER = "eager"


class RaceError(AssertionError):
    """Two accesses to the same bytes, one a write, with no happens-before edge between them."""


def _join(into: Clock, other: Clock) -> None:
    for agent, tick in other.items():
        if into.get(agent, 0) < tick:
            into[agent] = tick


@dataclass
class _Token:
    """One `record` of an event; `clock` is set when the record runs on its stream."""

    stream: ModelStream
    clock: Clock | None = None


@dataclass
class _Queued:
    issue: Clock
    """The host's clock when the host issued this entry."""
    run: Callable[[], None] | None = None
    token: _Token | None = None
    wait: _Token | None = None
    accesses: list[_Access] = field(default_factory=list)
    name: str = ""


@dataclass
class _Access:
    storage: int
    start: int
    stop: int
    write: bool
    agent: str = ""
    tick: int = 0
    op: str = ""


class ModelStream:
    """A stream: compute runs at once, copy and comm queue their work."""

    def __init__(self, model: AsyncStreamSet, name: str) -> None:
        self.model = model
        self.name = name
        self.clock: Clock = {}
        self.queue: deque[_Queued] = deque()

    def wait_event(self, event: ModelEvent) -> None:
        # CUDA semantics: the wait is on the event's latest record issued so far.
        self.model.issue(self, _Queued(dict(self.model.host.clock), wait=event.latest))

    def __repr__(self) -> str:
        return f"<{self.name} stream>"


class ModelEvent:
    def __init__(self, model: AsyncStreamSet) -> None:
        self.model = model
        self.latest: _Token | None = None

    def record(self, stream: object = None) -> None:
        target = stream if isinstance(stream, ModelStream) else self.model.current_stream()
        self.latest = _Token(target)
        self.model.issue(target, _Queued(dict(self.model.host.clock), token=self.latest))

    def synchronize(self) -> None:
        self.model.host_wait(self.latest)


class AsyncStreamSet(StreamSet):
    """See the module docstring."""

    def __init__(self, schedule: Schedule = Schedule.LAZY) -> None:
        super().__init__(torch.device("cpu"))
        self.schedule = schedule
        self.copies_registered_views = True  # registered views stand in as plain host tensors
        self.reads_host_in_place = False  # it models a device with memory of its own
        self.host = ModelStream(self, HOST)
        self._compute = ModelStream(self, COMPUTE)
        self.copy = ModelStream(self, COPY)
        self.comm = ModelStream(self, COMM)
        self._current: ModelStream | None = None
        self._host_storages: set[int] = set()
        self._watched: set[int] = set()
        self._log: dict[int, list[_Access]] = {}
        self._mode = _Mode(self)
        self.deferred = 0
        """Ops that were queued on the copy or communication stream (a test checks it is > 0)."""

    # -- StreamSet -------------------------------------------------------------------------
    def event(self) -> ModelEvent:  # type: ignore[override]
        return ModelEvent(self)

    def compute(self) -> ModelStream:  # type: ignore[override]
        return self._compute

    @contextlib.contextmanager
    def on(self, stream: object) -> Iterator[None]:
        assert isinstance(stream, ModelStream) and stream.name in (COPY, COMM, COMPUTE)
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self) -> None:
        for stream in (self.copy, self.comm):
            self._drain(stream)
        for stream in (self._compute, self.copy, self.comm):
            _join(self.host.clock, stream.clock)
        # Every access so far happens before anything the host issues from now on.
        self._log.clear()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = super().host_empty(numel, dtype)
        self._host_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> AsyncStreamSet:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.synchronize()
        finally:
            self._mode.__exit__(*exc)

    # -- scheduling ------------------------------------------------------------------------
    def current_stream(self) -> ModelStream:
        return self._current or self._compute

    def issue(self, stream: ModelStream, entry: _Queued) -> None:
        if stream.name in (COPY, COMM):
            stream.queue.append(entry)
            if self.schedule is Schedule.EAGER:
                self._pump()
        else:
            self._run(stream, entry)

    def host_wait(self, token: _Token | None) -> None:
        if token is not None:
            self._until(token)
            assert token.clock is not None
            _join(self.host.clock, token.clock)

    def _until(self, token: _Token) -> None:
        while token.clock is None:
            stream = token.stream
            assert stream.queue, f"{stream} has no queued record to wait for"
            self._run(stream, stream.queue.popleft())

    def _drain(self, stream: ModelStream) -> None:
        while stream.queue:
            self._run(stream, stream.queue.popleft())

    def _pump(self) -> None:
        """EAGER: run every queued entry whose waits are already satisfied."""
        progress = True
        while progress:
            progress = False
            for stream in (self.copy, self.comm):
                while stream.queue:
                    head = stream.queue[0]
                    if head.wait is not None and head.wait.clock is None:
                        break
                    self._run(stream, stream.queue.popleft())
                    progress = True

    def _run(self, stream: ModelStream, entry: _Queued) -> None:
        _join(stream.clock, entry.issue)
        if entry.wait is not None:
            self._until(entry.wait)
            assert entry.wait.clock is not None
            _join(stream.clock, entry.wait.clock)
        if entry.token is not None:
            entry.token.clock = dict(stream.clock)
        if entry.run is not None:
            stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
            self._check(stream, entry.accesses, entry.name)
            with _disable_current_modes():
                entry.run()

    # -- race detection --------------------------------------------------------------------
    def _check(self, stream: ModelStream, accesses: list[_Access], op: str) -> None:
        tick = stream.clock[stream.name]
        for access in accesses:
            if access.storage not in self._watched:
                continue
            log = self._log.setdefault(access.storage, [])
            for earlier in log:
                if earlier.agent == stream.name or not (earlier.write or access.write):
                    continue
                if earlier.stop <= access.start or access.stop <= earlier.start:
                    continue
                if earlier.tick > stream.clock.get(earlier.agent, 0):
                    raise RaceError(
                        f"{stream.name} {_verb(access)} bytes [{access.start}, {access.stop}) "
                        f"({op}) that {earlier.agent} {_verb(earlier)} ({earlier.op}) with no "
                        "happens-before edge between them: a wait is missing"
                    )
            log.append(_Access(access.storage, access.start, access.stop, access.write,
                               stream.name, tick, op))

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        accesses = _accesses(func, args, kwargs)
        stream = self._current
        if stream is not None and stream.name in (COPY, COMM) and accesses:
            if func not in _DEFERRABLE:
                raise NotImplementedError(f"the stream model cannot queue {func}")
            self.deferred += 1
            self._watched.update(access.storage for access in accesses)
            entry = _Queued(dict(self.host.clock), accesses=accesses, name=str(func))
            entry.run = lambda: _complete(func(*args, **kwargs))
            self.issue(stream, entry)
            if func is _ALLGATHER:
                return args[0], _done_work()
            return args[0]
        writes_host = any(a.write and a.storage in self._host_storages for a in accesses)
        agent = self.host if writes_host else self._compute
        if agent is self._compute:
            _join(agent.clock, self.host.clock)  # the host issued it after its earlier work
        agent.clock[agent.name] = agent.clock.get(agent.name, 0) + 1
        self._check(agent, accesses, str(func))
        result = func(*args, **kwargs)
        if all(returned.alias_info is None for returned in func._schema.returns):
            # Fresh storage: whatever an earlier buffer at this address saw is not its history.
            for tensor in _tensors(result):
                pointer = tensor.untyped_storage().data_ptr()
                self._watched.discard(pointer)
                self._log.pop(pointer, None)
        return result


class _Mode(TorchDispatchMode):
    def __init__(self, model: AsyncStreamSet) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):
            return func(*args, **kwargs)
        return self.model.dispatch(func, args, kwargs)


def _verb(access: _Access) -> str:
    return "writes" if access.write else "reads"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def _accesses(func: Any, args: tuple, kwargs: dict) -> list[_Access]:
    """The byte ranges of the tensor arguments, each marked read or written (per the schema)."""
    found = []
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        write = argument.alias_info is not None and argument.alias_info.is_write
        for tensor in _tensors(value):
            if tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            size = tensor.element_size()
            extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
            start = tensor.storage_offset() * size
            found.append(_Access(tensor.untyped_storage().data_ptr(), start,
                                 start + extent * size, write))
    return found


def _complete(result: Any) -> None:
    """A collective run from a queue completes before the stream's next entry."""
    if isinstance(result, tuple) and len(result) == 2 and hasattr(result[1], "wait"):
        result[1].wait()


def _done_work() -> Any:
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()
