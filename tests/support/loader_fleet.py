"""Test helpers for the loader: tiny checkpoints, and groups of real `dlo cache fill` processes.

Each rank runs as its own process with its own cache root (its "node"), its own counting proxy in
front of the S3 server (so the bytes it read are counted outside the loader), and the usual
torch.distributed environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server, free_port, upload_tree
from safetensors.numpy import save_file


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint uploaded to the test server: its source URI and every file's bytes."""

    source: str
    files: dict[str, bytes]


BUCKET = "models"
CHUNK_BYTES = 128 << 10
LOADER_SETTINGS = {
    "readers": 4,
    "chunk_bytes": CHUNK_BYTES,
    "memory_limit_bytes": 8 * CHUNK_BYTES,
    "max_retries": 4,
    "timeout_s": 90.0,
    "rendezvous_timeout_s": 60.0,
    "path_style": True,
}
PROCESS_TIMEOUT_S = 120
CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("contract", "cli", "runtime", "loader_image", "operator", "bench")
"""Where this checkout's packages live (pyproject's `packages.find`)."""


def checkout_env(**extra: str) -> dict[str, str]:
    """The suite's environment for a `dlo` process, importing this checkout's packages first:
    the virtual environment's editable install may point at another copy of the project."""
    ours = os.pathsep.join(str(CHECKOUT / name) for name in PACKAGE_DIRS)
    inherited = os.environ.get("PYTHONPATH")
    path = ours + (os.pathsep + inherited if inherited else "")
    return {**os.environ, **DUMMY_CREDENTIALS, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
            **extra}


def write_checkpoint(directory: Path, *, seed: int = 0) -> dict[str, bytes]:
    """A diffusers-like layout of about 3.3 MiB: two safetensors shards and a config."""
    rng = np.random.default_rng(seed)
    transformer = directory / "transformer"
    transformer.mkdir(parents=True)
    save_file({f"blocks.{i}.weight": rng.standard_normal(100_000 + 1000 * i, dtype=np.float32)
               for i in range(6)}, str(transformer / "model-00001-of-00002.safetensors"))
    save_file({f"blocks.{6 + i}.weight": rng.standard_normal(50_000, dtype=np.float32)
               for i in range(4)} | {"norm.bias": np.zeros(7, dtype=np.float16)},
              str(transformer / "model-00002-of-00002.safetensors"))
    (transformer / "config.json").write_text(json.dumps({"num_layers": 10}))
    (directory / "README.md").write_text("not included by the default globs\n")
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def upload_files(s3: S3Server, prefix: str, files: dict[str, bytes], tmp: Path) -> str:
    """Upload `files` (relative name -> bytes) under `prefix`; returns the source URI."""
    for name, data in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    upload_tree(s3, BUCKET, prefix, tmp)
    return f"s3://{BUCKET}/{prefix}"


def included(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files the default include globs (`*.safetensors`, `*.json`) select."""
    return {k: v for k, v in files.items() if k.endswith((".safetensors", ".json"))}


def entry_files(cache_root: Path) -> dict[str, bytes]:
    """Every file of the single entry under `cache_root` (manifest excluded)."""
    entries = list((cache_root / "v1" / "entries").iterdir())
    assert len(entries) == 1, entries
    return {p.relative_to(entries[0]).as_posix(): p.read_bytes()
            for p in sorted(entries[0].rglob("*")) if p.is_file() and p.name != "manifest.json"}


def no_entry(cache_root: Path) -> bool:
    """True when the cache holds neither an entry nor a leftover temporary directory."""
    base = cache_root / "v1"
    return not any((base / "entries").glob("*")) and not any((base / "tmp").glob("*"))


@dataclass
class Outcome:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hold:
    """Where a loader of a group stops for good, its heartbeat still beating, so the others wait
    for it there until the test kills it: its `number`-th call of `group.Group.<method>`
    (`support/hold/sitecustomize.py`), after it created `marker` (`wait` returns then)."""

    method: str
    number: int
    marker: Path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {"DLO_TEST_HOLD": f"{self.method}:{self.number}:{self.marker}",
                "PYTHONPATH": os.pathsep.join((str(HOLD_HOOK), base["PYTHONPATH"]))}

    def wait(self, timeout_s: float = 60.0) -> None:
        wait_until(self.marker.exists, timeout_s)


HOLD_HOOK = Path(__file__).resolve().parent / "hold"


@dataclass
class Fleet:
    """`world` loaders sharing one source; rank r talks to S3 through `endpoints[r]`."""

    tmp: Path
    source: str
    world: int
    endpoints: list[str]
    mode: str = "multi-reader"
    settings: dict[str, Any] = field(default_factory=dict)
    master_port: int = field(default_factory=free_port)
    origin: str | None = None
    """The settings document's origin (the operator's CR), as the operator writes it."""

    def root(self, rank: int) -> Path:
        return self.tmp / f"node{rank}" / "cache"

    def command(self, rank: int, *extra: str) -> list[str]:
        config = self.tmp / "settings.json"
        document = {"loader": LOADER_SETTINGS | self.settings}
        config.write_text(json.dumps(document | ({"origin": self.origin} if self.origin else {})))
        return [
            sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
            "--source", self.source, "--endpoint-url", self.endpoints[rank], "--mode", self.mode,
            "--cache-root", str(self.root(rank)), "--rank", str(rank),
            "--world-size", str(self.world), "--master-addr", "127.0.0.1",
            "--master-port", str(self.master_port),
            "--entry-file", str(self.tmp / f"node{rank}" / "entry.json"),
            "--summary-file", str(self.tmp / f"node{rank}" / "termination-log"), *extra,
        ]

    def start(self, rank: int, *extra: str, hold: Hold | None = None) -> subprocess.Popen[str]:
        """Start rank `rank`'s loader; `hold`: where it stops for good (see `Hold`)."""
        (self.tmp / f"node{rank}").mkdir(parents=True, exist_ok=True)
        env = checkout_env(DLO_POD_NAME=self.pod(rank), DLO_NODE_NAME=self.node(rank))
        if hold is not None:
            env |= hold.env(env)
        return subprocess.Popen(self.command(rank, *extra), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    @staticmethod
    def pod(rank: int) -> str:
        """The pod name rank `rank` is told it runs in (its group names it by this)."""
        return f"loader-{rank}"

    @staticmethod
    def node(rank: int) -> str:
        """The node name rank `rank` is told it runs on."""
        return f"node{rank}"

    def held_and_killed(self, victim: int, hold: Hold) -> list[Outcome]:
        """Start every rank, `victim` stopping at `hold`; SIGKILL it there and return the
        others' outcomes."""
        processes = {rank: self.start(rank, hold=hold if rank == victim else None)
                     for rank in range(self.world)}
        with ended(*processes.values()):
            hold.wait()
            os.kill(processes[victim].pid, signal.SIGKILL)
            return [finish(rank, processes[rank]) for rank in processes if rank != victim]

    def run(self, *extra: str, ranks: list[int] | None = None) -> list[Outcome]:
        chosen = ranks if ranks is not None else range(self.world)
        processes = {r: self.start(r, *extra) for r in chosen}
        return [finish(rank, process) for rank, process in processes.items()]


@contextlib.contextmanager
def ended(*processes: subprocess.Popen[str]) -> Iterator[None]:
    """The loaders and their pipes end with the test, whatever it found."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.communicate()


def finish(rank: int, process: subprocess.Popen[str]) -> Outcome:
    try:
        stdout, stderr = process.communicate(timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    lines = stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return Outcome(rank, process.returncode, stdout, stderr, summary)


class OpenWatch:
    """Notices the next time any process opens `path` (Linux inotify `IN_OPEN`), so a test can
    tell that a loader reached a step without guessing how long it takes."""

    _IN_OPEN = 0x20

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0 or self._libc.inotify_add_watch(
                self._fd, os.fsencode(path), self._IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"cannot watch {path}")

    def wait(self, timeout_s: float = 60.0) -> None:
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        if not ready:
            raise AssertionError(f"nobody opened the watched file within {timeout_s} s")

    def close(self) -> None:
        os.close(self._fd)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll `predicate` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.05)


def formed(port: int) -> int:
    """How many loaders have their process group up (connected to every peer) in the group whose
    master listens on `port` (0: none yet). Counting those that only joined the store is not
    enough: one killed before its process group is up leaves the others to fill alone."""
    import datetime

    import torch.distributed as dist
    from dlo_loader import transport

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=1))
        return int(store.add(transport.FORMED_KEY, 0))
    except (RuntimeError, dist.DistError):
        return 0


def published_as_alone(fleet: Fleet, outcomes: list[Outcome], without: list[int],
                       checkpoint: Checkpoint, s3: S3Server) -> None:
    """Every survivor published what a fill alone publishes, naming the members it lost."""
    alone = Fleet(fleet.tmp / "alone", checkpoint.source, 1, [s3.endpoint_url])
    [single] = alone.run()
    assert single.returncode == 0, single.stderr
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["status"] == "ok" and outcome.summary["without"] == without
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert entry_files(fleet.root(outcome.rank)) == entry_files(alone.root(0))
    for rank in without:
        entries = fleet.root(rank) / "v1" / "entries"
        assert not entries.exists() or not any(entries.iterdir())
