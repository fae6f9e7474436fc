"""Rank-local serving: no collective couples the ranks' forwards, so each rank takes the next
queued image as soon as it is free, without waves.

Rank 0 runs its own images on the engine thread and, for every other rank, a dispatcher thread
that sends that rank one job at a time over a gloo group of the two of them
(`broadcast_object_list` from rank 0, the PNG back from the rank), a tick every
`engine.HEARTBEAT_S` while nothing comes, and STOP once the queue is closed and empty. Each pair
has its own group, so the dispatchers never wait for each other.
"""

from __future__ import annotations

import threading
from typing import Any

from dlo_server.engine import (
    HEARTBEAT_S, STOP, TICK, Model, broadcast, failing_on_error, make_image, resolve,
)
from dlo_server.metrics import ServerMetrics
from dlo_server.waves import WaveQueue


def lead_local(model: Model, queue: WaveQueue, pairs: dict[int, Any],
               metrics: ServerMetrics) -> None:
    """Rank 0: its own images here, one dispatcher per other rank; returns when all stopped,
    raising the first dispatcher's error (the queue is failed at once, so all stop)."""
    errors: list[BaseException] = []
    dispatchers = [threading.Thread(target=_dispatch, name=f"dlo-rank{rank}",
                                    args=(rank, group, queue, metrics, errors))
                   for rank, group in pairs.items()]
    for thread in dispatchers:
        thread.start()
    try:
        while (pending := queue.take_wave(HEARTBEAT_S, size=1)) != []:
            for item in pending or ():
                with failing_on_error([item]):
                    resolve(item, make_image(model, item.job, 0), metrics)
    finally:
        for thread in dispatchers:
            thread.join()
    if errors:
        raise errors[0]


def follow_local(model: Model, rank: int, group: Any) -> None:
    """Rank r: the jobs rank 0 sends, one at a time, until STOP."""
    while (order := broadcast(None, group)) != STOP:
        if order != TICK:
            broadcast(make_image(model, order, rank), group, src=rank)


def _dispatch(rank: int, group: Any, queue: WaveQueue, metrics: ServerMetrics,
              errors: list[BaseException]) -> None:
    try:
        while (pending := queue.take_wave(HEARTBEAT_S, size=1)) != []:
            if pending is None:
                broadcast(TICK, group)
                continue
            [item] = pending
            with failing_on_error(pending):
                broadcast(item.job, group)
                resolve(item, broadcast(None, group, src=rank), metrics)
        broadcast(STOP, group)
    except BaseException as exc:  # noqa: BLE001 (raised by lead_local)
        errors.append(exc)
        queue.fail_all(exc)
