"""A separate process that publishes, holds or breaks cache entries for the cache tests.

Run as `python cache_worker.py COMMAND ROOT SEED [options]`; prints one JSON line as its result.
Tests start several of these at once to exercise the kernel locks across real processes.

`publish-steps` names every durable step of a publication as it happens (each file written, each
fsync, the manifest's write, the rename, the use lock, the unlock) and, with `--crash-at N`,
SIGKILLs itself right after step N (before it, for the unlock), so a test can kill the writer at
every step in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

from dlo_contract.cache import (
    CacheError,
    FileRecord,
    begin_publication,
    entry_id,
    locks,
    open_entry,
    runtime_identity,
)
from dlo_contract.cache import publish as publish_module
from dlo_contract.cache.layout import CacheRoot


def identity_for(seed: str) -> dict:
    return runtime_identity({"model": seed, "tp_world_size": 1, "tp_rank": 0}, "ab" * 32)


def payload(seed: str, size: int) -> bytes:
    block = (seed.encode() * 64)[:64]
    return (block * (size // 64 + 1))[:size]


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def publish(args: argparse.Namespace) -> dict:
    """Publish (or join) the entry of `seed`; optionally stop halfway and wait to be killed."""
    if args.go:
        _wait_for(Path(args.go))
    ident = identity_for(args.seed)
    data = payload(args.seed, args.size)
    with begin_publication(
        args.root, entry_id(ident), expected_bytes=args.expected or args.size, lock_timeout_s=30
    ) as pub:
        if pub.existing is not None:
            return {"wrote": False, "path": str(pub.existing)}
        with open(pub.tmp_dir / "weights.bin", "wb") as out:
            out.write(data[: args.size // 2])
            out.flush()
            if args.marker:
                Path(args.marker).touch()
            time.sleep(args.hold_s)
            out.write(data[args.size // 2 :])
        path = pub.commit(
            "runtime", ident, [FileRecord("weights.bin", args.size)], producer=f"pid-{os.getpid()}"
        )
    return {"wrote": True, "path": str(path)}


def hold_use(args: argparse.Namespace) -> dict:
    """Open the entry (shared `.use`), say so, and keep it until stdin closes."""
    with open_entry(args.root, entry_id(identity_for(args.seed))):
        Path(args.marker).touch()
        sys.stdin.read()
    return {"held": True}


def hold_publish(args: argparse.Namespace) -> dict:
    """Hold the entry's `.publish` lock until stdin closes."""
    cache = CacheRoot(args.root)
    cache.ensure()
    with locks.lock(cache.publish_lock(entry_id(identity_for(args.seed))), timeout_s=5):
        Path(args.marker).touch()
        sys.stdin.read()
    return {"held": True}


def publish_limited(args: argparse.Namespace) -> dict:
    """Publish under RLIMIT_FSIZE so the write fails with EFBIG; report the error."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    try:
        publish(args)
    except CacheError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "needed": getattr(exc, "needed_bytes", None),
            "free": getattr(exc, "free_bytes", None),
        }
    return {"error": None}


class StepRecorder:
    """Wraps the calls a publication makes; `step(name)` records one and may end the process."""

    def __init__(self, root: CacheRoot, crash_at: int) -> None:
        self.root = root.tmp.parent.resolve()  # the layout directory holding tmp/ and entries/
        self.crash_at = crash_at
        self.steps: list[str] = []

    def step(self, name: str) -> None:
        self.steps.append(name)
        if len(self.steps) == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def where(self, fd: int) -> str:
        """The path behind `fd`, relative to the root, with the tmp dir's nonce as `*`."""
        parts = list(Path(os.readlink(f"/proc/self/fd/{fd}")).relative_to(self.root).parts)
        if parts[0] == "tmp" and len(parts) > 1:
            parts[1] = "*"
        return "/".join(parts)

    def install(self, publish_lock: Path) -> None:
        fsync, write, rename = os.fsync, os.write, os.rename
        use_lock, release = publish_module._create_use_lock, locks.FileLock.release

        def recorded_fsync(fd: int) -> None:
            fsync(fd)
            self.step(f"fsync {self.where(fd)}")

        def recorded_write(fd: int, data: bytes) -> int:
            name = self.where(fd)
            written = write(fd, data)
            self.step(f"write {name}")
            return written

        def recorded_rename(src: str | Path, dst: str | Path) -> None:
            rename(src, dst)
            self.step(f"rename tmp/* {Path(dst).parent.name}/*")

        def recorded_use_lock(root: CacheRoot, entry: str) -> None:
            use_lock(root, entry)
            self.step("create use lock")

        def recorded_release(lock: locks.FileLock) -> None:
            if lock.fd is not None and Path(lock.path) == publish_lock:
                self.step("unlock")
            release(lock)

        os.fsync, os.write, os.rename = recorded_fsync, recorded_write, recorded_rename
        publish_module._create_use_lock = recorded_use_lock
        locks.FileLock.release = recorded_release  # type: ignore[method-assign]


def publish_steps(args: argparse.Namespace) -> dict:
    """Publish two files, naming each step; SIGKILL at step `--crash-at` (0: never)."""
    ident = identity_for(args.seed)
    entry = entry_id(ident)
    recorder = StepRecorder(CacheRoot(args.root), args.crash_at)
    files = {"a.bin": payload(args.seed, args.size), "b.bin": payload("b" + args.seed, 96)}
    with begin_publication(
        args.root, entry, expected_bytes=sum(map(len, files.values())), lock_timeout_s=10
    ) as pub:
        if pub.existing is not None:
            return {"wrote": False, "steps": []}
        recorder.install(CacheRoot(args.root).publish_lock(entry))
        for name, data in files.items():
            fd = os.open(pub.tmp_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        pub.commit(
            "runtime", ident, [FileRecord(name, len(data)) for name, data in files.items()]
        )
    return {"wrote": True, "steps": recorder.steps}


COMMANDS = {
    "publish": publish,
    "hold-use": hold_use,
    "hold-publish": hold_publish,
    "publish-limited": publish_limited,
    "publish-steps": publish_steps,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("root")
    parser.add_argument("seed")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--expected", type=int, default=0)
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--marker", default="")
    parser.add_argument("--go", default="")
    parser.add_argument("--fsize-limit", type=int, default=0)
    parser.add_argument("--crash-at", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(COMMANDS[args.command](args)), flush=True)


if __name__ == "__main__":
    main()
