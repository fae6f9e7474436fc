"""`dlo serve`: the reference inference server of a dlo pod.

Owns the server's processes and its lifetime. The command is rank 0: it serves HTTP
(`dlo_server.app`) from the start, so the probes answer while the loader fills, and starts ranks
1..G-1 as child processes of the same command (`--rank`), one per device. Each rank joins the group
(gloo on the CPU; gloo and NCCL on CUDA), builds its model with the pod API (`engine.start_model`)
and serves: in AllGather mode the wave loop (`engine.lead` on rank 0, `engine.follow` on the
others), in rank-local mode one job at a time per rank (`local`). SIGTERM (or Ctrl-C) on rank 0:
readiness fails at once, new requests get 503, the queued and running ones finish, rank 0 tells the
others to stop, every rank closes its offload handle and destroys its process groups, and the
command exits 0 once its children have. The children ignore SIGTERM and SIGINT: they stop when rank
0 says so (or fail when it is gone). A server that is broken (a rank exited, a failed start) fails
every probe and exits 1 on SIGTERM. A wave that does not end within `--stop-timeout` after SIGTERM
(a rank stopped or lost) does not hold the pod past its grace period: the images still queued get
503, the ranks are killed and the command exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from dlo_server.metrics import ServerMetrics
from dlo_server.pipeline import Output, TextEncoders
from dlo_server.requests import Limits
from dlo_server.status import State, Status
from dlo_server.waves import QueueClosed, WaveQueue

log = logging.getLogger(__name__)

_CHILD_POLL_S = 0.5
_CHILD_GRACE_S = 30.0
_ANSWER_S = 5.0
"""Seconds the HTTP side gives its handlers to write their answers once the engine stopped
(aiohttp's `shutdown_timeout`); a handler still waiting on a wave that never ended is cancelled."""
_UNSTARTED = (State.JOINING, State.FILLING)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    add("--model", default=Limits.model,
        help="name of the served model; a request's `model`, when given, must equal it "
             "(default: %(default)s)")
    add("--ranks", type=int, help="data-parallel ranks, one process and device each "
                                  "(default: the settings' parallel.dp)")
    add("--queue-size", type=int, default=16,
        help="images that may wait; a request that does not fit gets 503 (default: %(default)s)")
    add("--max-n", type=int, default=Limits.max_n, help="images per request (default: %(default)s)")
    add("--max-steps", type=int, default=Limits.max_steps,
        help="num_inference_steps at most (default: %(default)s)")
    add("--max-side", type=int, default=Limits.max_side,
        help="width and height at most, in pixels (default: %(default)s)")
    add("--threads", type=int, help="torch CPU threads per rank (default: torch's own choice)")
    add("--text-encoders", choices=[choice.value for choice in TextEncoders],
        default=TextEncoders.DEVICE.value,
        help="where the text encoders live: on the device for the server's life, or in host "
             "memory, each moved to the device for its own forward only (default: %(default)s)")
    add("--collective-timeout", type=float, default=1800.0, metavar="S",
        help="seconds a collective of the group may wait (default: %(default)s)")
    add("--stop-timeout", type=float, default=20.0, metavar="S",
        help="seconds SIGTERM waits for the queued and running images before it answers what "
             "is left with 503 and stops the ranks; below Kubernetes' default grace period of "
             "30 s, less the time to answer and stop (default: %(default)s)")
    add("--rank", type=int, default=0, help=argparse.SUPPRESS)
    add("--master-port", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    world = args.ranks or _settings_dp()
    if args.rank > 0:
        return _follower(args, world)
    return asyncio.run(_leader(args, world))


def _settings_dp() -> int:
    from dlo_contract.settings import load_settings

    return load_settings().parallel.dp


def _follower(args: argparse.Namespace, world: int) -> int:
    from dlo_server.engine import follow
    from dlo_server.local import follow_local

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when the group stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with _rank(args, args.rank, world, args.master_port, Status()) as (model, group, pairs):
        if model.allgather:
            follow(model, args.rank, group)
        else:
            follow_local(model, args.rank, pairs[args.rank])
    return 0


async def _leader(args: argparse.Namespace, world: int) -> int:
    from aiohttp import web

    from dlo_server.app import Server

    status, metrics = Status(), ServerMetrics()
    queue = WaveQueue(args.queue_size, world)
    server = Server(status, queue, metrics)
    master_port = args.master_port or _free_port()
    # A client that goes away cancels its handler, which drops its queued jobs (app.py).
    runner = web.AppRunner(server.app(), handler_cancellation=True,
                           shutdown_timeout=_ANSWER_S)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("dlo serve: listening on %s:%d, %d rank(s)", args.host, args.port, world)
    children = [_start_child(args, rank, world, master_port) for rank in range(1, world)]
    engine = threading.Thread(target=_lead_rank, name="dlo-engine", daemon=True,
                              args=(args, world, master_port, server))
    engine.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watcher = asyncio.create_task(_watch_children(children, status, queue, stop))
    await stop.wait()
    watcher.cancel()
    return await _shutdown(status, queue, engine, runner, children, args.stop_timeout)


def _lead_rank(args: argparse.Namespace, world: int, master_port: int, server: Any) -> None:
    """Rank 0's engine thread: start, serve waves, stop; a failure breaks the server."""
    from dlo_runtime.metrics import OffloadCollector
    from dlo_server.engine import lead
    from dlo_server.local import lead_local

    status, queue = server.status, server.queue
    try:
        with _rank(args, 0, world, master_port, status) as (model, group, pairs):
            server.limits = Limits(size_multiple=model.sampler.size_multiple,
                                   model=args.model, max_side=args.max_side,
                                   max_steps=args.max_steps, max_n=args.max_n,
                                   videos=model.sampler.family.output is Output.VIDEO,
                                   frame_multiple=model.sampler.frame_multiple)
            server.metrics.registry.register(OffloadCollector(model.handle.stats))
            status.set(State.READY, f"{world} rank(s), "
                                    f"{'allgather' if model.allgather else 'rank-local'} mode")
            if model.allgather:
                lead(model, queue, group, server.metrics)
            else:
                lead_local(model, queue, pairs, server.metrics)
    except BaseException as exc:  # noqa: BLE001 (reported by the probes and the log)
        log.exception("dlo serve: the engine stopped")
        status.set(State.BROKEN, f"{type(exc).__name__}: {exc}")
        queue.fail_all(exc)


@contextmanager
def _rank(args: argparse.Namespace, rank: int, world: int, master_port: int | None,
          status: Status) -> Iterator[tuple[Any, Any, dict[int, Any]]]:
    """Join the group (when there is one), start the model, wait for every rank; on the way
    out close the offload handle, then destroy the process groups. Yields the model, the
    group of all ranks for AllGather waves, and rank 0's pair group with each other rank for
    rank-local serving (gloo, whatever the devices)."""
    import torch
    import torch.distributed as dist

    from dlo_server.engine import start_model

    group, pairs = None, {}
    if world > 1:
        status.set(State.JOINING, f"joining the group of {world} ranks")
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=args.collective_timeout))
        group = dist.new_group(backend="gloo")
        pairs = {peer: dist.new_group([0, peer], backend="gloo") for peer in range(1, world)}
    try:
        device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
        model = start_model(status, device, TextEncoders(args.text_encoders))
        try:
            if group is not None:
                dist.barrier(group=group)
            yield model, group, pairs
        finally:
            model.handle.close()
    finally:
        if group is not None:
            dist.destroy_process_group()


def _start_child(args: argparse.Namespace, rank: int, world: int,
                 master_port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "dlo_cli.main", "serve", "--rank", str(rank),
            "--ranks", str(world), "--master-port", str(master_port),
            "--collective-timeout", str(args.collective_timeout)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    argv += ["--text-encoders", args.text_encoders]
    return subprocess.Popen(argv)


async def _watch_children(children: list[subprocess.Popen[bytes]], status: Status,
                          queue: WaveQueue, stop: asyncio.Event) -> None:
    """A rank that exits before rank 0 asked it to breaks the server."""
    while not stop.is_set():
        for rank, child in enumerate(children, start=1):
            if child.poll() is not None and status.state is not State.STOPPING:
                message = f"rank {rank} exited with status {child.returncode}"
                log.error("dlo serve: %s", message)
                status.set(State.BROKEN, message)
                queue.fail_all(RuntimeError(message))
                return
        await asyncio.sleep(_CHILD_POLL_S)


async def _shutdown(status: Status, queue: WaveQueue, engine: threading.Thread, runner: Any,
                    children: list[subprocess.Popen[bytes]], stop_timeout: float) -> int:
    """Finish what was accepted, stop the ranks, close the HTTP side; 0 when all went well."""
    before = status.state
    status.set(State.STOPPING, "stopping: finishing the queued requests, taking no new ones")
    log.info("dlo serve: stopping (was %s); %d image(s) queued", before.value, queue.depth)
    queue.close()
    waits = before not in _UNSTARTED and before is not State.BROKEN
    if waits:
        await asyncio.to_thread(engine.join, stop_timeout)
    stuck = engine.is_alive() and waits
    if stuck:  # a wave that cannot end (a rank stopped or lost) must not outlast the grace period
        log.error("dlo serve: the images in flight did not finish within --stop-timeout %g s; "
                  "stopping the ranks", stop_timeout)
        queue.fail_all(QueueClosed("the server stopped before making this image; retry"))
    await runner.cleanup()
    clean = waits and not stuck and status.state is State.STOPPING
    for child in children:
        if not clean:
            child.kill()
        try:
            await asyncio.to_thread(child.wait, _CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            clean = False
    clean = clean and all(child.returncode == 0 for child in children)
    log.info("dlo serve: stopped %s", "cleanly" if clean else "after a failure")
    if stuck:  # the engine thread is still inside a collective: finalizing torch under it aborts
        logging.shutdown()
        os._exit(1)
    return 0 if clean or before in _UNSTARTED else 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
