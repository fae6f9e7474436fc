"""The backend on a CPU stream model whose copy and communication streams really run later
(`support.async_streams`): offloaded forwards stay bit-identical to the resident model in
rank-local, staged and direct modes, and no two accesses race, so every wait the hot path relies
on (`ready` before compute, `free` and `ready` before a copy into a slot, `consumed` before a
staging slot is repacked) is declared. AllGather mode runs on it in `test_backend_allgather_fast`.

Each case runs under both schedules: LAZY (queued work runs only when a wait needs it, so compute
that skips `ready` reads stale weights) and EAGER (queued work runs as soon as its waits allow,
so a copy that skips `free` overwrites a slot at once)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.async_streams import AsyncStreamSet, RaceError, Schedule
from support.runtime_helpers import RANK_LOCAL, forward, mapped_plan, run_case, strip_parameters

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.streams import StreamSet
from dlo_runtime.transfer import DirectSource, MappedSource, StagedSource


class Registration:
    """Stands for the device runtime's registration of the plan's views."""

    def __init__(self) -> None:
        self.unregistered = False

    def unregister(self) -> None:
        self.unregistered = True


def test_a_read_that_waits_for_nothing_sees_stale_bytes_and_is_reported() -> None:
    streams = AsyncStreamSet(Schedule.LAZY)
    with streams:
        source, target = torch.arange(4.0), torch.zeros(4)
        with streams.on(streams.copy):
            target.copy_(source, non_blocking=True)
        assert torch.equal(target.clone(), torch.zeros(4))
        with pytest.raises(RaceError) as caught:
            streams.synchronize()
    assert str(caught.value) == (
        "copy writes bytes [0, 16) (aten.copy_.default) that compute reads (aten.clone.default) "
        "with no happens-before edge between them: a wait is missing"
    )


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_a_read_after_waiting_on_the_copy_sees_its_bytes(schedule: Schedule) -> None:
    streams = AsyncStreamSet(schedule)
    with streams:
        source, target = torch.arange(4.0), torch.zeros(4)
        ready = streams.event()
        with streams.on(streams.copy):
            target.copy_(source, non_blocking=True)
            ready.record(streams.copy)
        ran_at_issue = not streams.copy.queue
        streams.compute().wait_event(ready)
        assert torch.equal(target.clone(), source)
    assert ran_at_issue is (schedule is Schedule.EAGER)


def test_an_eager_copy_waits_for_the_event_it_was_told_to_wait_for() -> None:
    streams = AsyncStreamSet(Schedule.EAGER)
    with streams:
        target = torch.zeros(4)
        free = streams.event()
        with streams.on(streams.comm):
            target.copy_(torch.ones(4))
            free.record(streams.comm)
        twos, done = torch.full((4,), 2.0), streams.event()
        with streams.on(streams.copy):
            streams.copy.wait_event(free)
            target.copy_(twos)
            done.record(streams.copy)
        streams.compute().wait_event(done)
        assert torch.equal(target, twos)
        with pytest.raises(RaceError, match="^copy writes bytes \\[0, 16\\) .* compute reads"):
            with streams.on(streams.copy):
                target.copy_(torch.ones(4))  # no `free` after the read above: runs at once


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [("flux", Schedule.LAZY), ("sd3", Schedule.EAGER), ("wan", Schedule.LAZY),
     ("wan", Schedule.EAGER)],
    ids=lambda value: getattr(value, "value", value),
)
def test_rank_local_forward_is_exact_on_async_streams(kind: str, schedule: Schedule) -> None:
    streams = AsyncStreamSet(schedule)
    outcome = run_case(kind, RANK_LOCAL, streams=streams)
    assert (outcome.equal, outcome.equal_second_step, outcome.equal_after_disable) == (
        True, True, True,
    )
    assert streams.deferred > 0


def _mapped_run(schedule: Schedule, *, registered: bool) -> tuple[type, bool, bool]:
    """(source class, offloaded forwards exact, registration undone at disable)."""
    reference = tiny_model("flux")
    inputs = example_inputs("flux", reference)
    expected = forward(reference, inputs)
    plan, _ = mapped_plan(reference)
    registration = Registration()
    if registered:
        plan.attach_registration(registration)
    model = tiny_model("flux", seed=7)
    strip_parameters(model)
    streams = AsyncStreamSet(schedule)
    with streams:
        backend = DistributedLayerwiseOffloadBackend(
            model, settings=RANK_LOCAL, device="cpu", host_plan=plan, streams=streams
        )
        with backend:
            kind = type(backend._source)
            exact = all(torch.equal(forward(model, inputs), expected) for _ in range(3))
        exact = exact and torch.equal(forward(model, inputs), expected)
    return kind, exact, registration.unregistered


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_staged_sources_are_exact_on_async_streams(schedule: Schedule) -> None:
    assert _mapped_run(schedule, registered=False) == (StagedSource, True, False)


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_registered_views_are_copied_directly_and_exactly(schedule: Schedule) -> None:
    assert _mapped_run(schedule, registered=True) == (DirectSource, True, True)


def test_the_cpu_uses_mapped_views_in_place_even_when_registered() -> None:
    """The CPU computes on host memory: the mapped views are the weights, nothing is copied
    (only a device with memory of its own copies registered views, `DirectSource`)."""
    streams = StreamSet(torch.device("cpu"))
    assert streams.reads_host_in_place and not streams.copies_registered_views
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    plan, _ = mapped_plan(reference)
    plan.attach_registration(Registration())
    model = tiny_model("wan", seed=7)
    strip_parameters(model)
    with DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=plan
    ) as backend:
        assert isinstance(backend._source, MappedSource)
        assert backend.slot_bytes == 0
        assert all(torch.equal(forward(model, inputs), expected) for _ in range(2))
        stats = backend.stats()
        assert stats.total.bytes_h2d == 0 and stats.total.blocks_loaded > 0
    assert torch.equal(forward(model, inputs), expected)


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_a_skipped_block_and_a_raising_block_stay_exact_on_async_streams(
    schedule: Schedule,
) -> None:
    reference = tiny_model("sd3")
    inputs = example_inputs("sd3", reference)
    expected_skip = forward(reference, inputs | {"skip_layers": [1]})
    expected = forward(reference, inputs)
    model = tiny_model("sd3")
    failures = [RuntimeError("injected")]

    def fail_once(*_: Any) -> None:
        if failures:
            raise failures.pop()

    streams = AsyncStreamSet(schedule)
    with streams:
        backend = DistributedLayerwiseOffloadBackend(
            model, settings=RANK_LOCAL, device="cpu", streams=streams
        )
        with backend:
            assert torch.equal(forward(model, inputs | {"skip_layers": [1]}), expected_skip)
            handle = model.transformer_blocks[1].register_forward_pre_hook(fail_once)
            with pytest.raises(RuntimeError, match="injected"):
                forward(model, inputs)
            handle.remove()
            assert torch.equal(forward(model, inputs), expected)
