"""Start a world of real gloo ranks for a test module: each rank runs a worker's `main(rank,
world, port, out_dir)` and writes `rank<r>.json`; the results come back in rank order."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(main: Callable[..., None], world: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run `main` on `world` spawned ranks (their failure fails the caller) and read each rank's
    JSON result."""
    mp.spawn(main, args=(world, free_port(), str(out_dir)), nprocs=world)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world)]
