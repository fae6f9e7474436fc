"""Shared helpers for the cache tests: publish small entries here, run workers elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dlo_contract.cache import (
    CacheRoot,
    FileRecord,
    ObjectIdentity,
    checkpoint_identity,
    entry_id,
    publish_entry,
)


def publish_files(
    root: CacheRoot, source: str, files: dict[str, bytes], **records: FileRecord
) -> str:
    """Publish `files` as a checkpoint entry of `source`; returns the entry id."""
    ident = checkpoint_identity(
        source,
        [ObjectIdentity(name, len(data), f"etag-{len(data)}") for name, data in files.items()],
    )
    entry = entry_id(ident)

    def write(tmp: Path) -> list[FileRecord]:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        return [records.get(name, FileRecord(name, len(data))) for name, data in files.items()]

    publish_entry(
        root,
        entry,
        "checkpoint",
        ident,
        write,
        expected_bytes=sum(map(len, files.values())),
        lock_timeout_s=5,
    )
    return entry


def dlo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `dlo` command line in a fresh process (with `env` added to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "dlo_cli.main", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


WORKER = Path(__file__).with_name("cache_worker.py")
HANG_GUARD_S = 20.0


class Workers:
    """Starts `cache_worker.py` processes and makes sure none outlives the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def result(proc: subprocess.Popen[str]) -> dict:
        """Close the worker's stdin (the "let go" signal for holders) and read its result."""
        out, err = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    @staticmethod
    def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
        """Wait until the worker creates `path` (it signals a point in its protocol)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"worker exited early: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"worker never reached {path.name}")
            time.sleep(0.01)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
