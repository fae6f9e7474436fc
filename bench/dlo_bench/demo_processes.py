"""Child processes of `dlo demo`: start them, wait for them with a deadline, stop them all.

Owns the lifetime of the loader and runtime processes the demo starts. Each child runs in a
session of its own, with stdout and stderr in files of the demo's work directory, so that a
Ctrl-C in the terminal reaches the demo alone and the demo stops every child (and anything the
child started) by its process group. `sigterm_as_interrupt` turns SIGTERM into the same path as
Ctrl-C. Called by `dlo_bench.demo`; it knows nothing about what the children compute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dlo_contract.errors import PermanentError

_STOP_GRACE_S = 5.0
_TAIL_LINES = 12


class DemoError(PermanentError):
    """A step of the demo failed; the message names the step and what went wrong."""


@dataclass
class Child:
    """One started process and the files holding its output."""

    name: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    def stderr_tail(self) -> str:
        lines = self.stderr_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-_TAIL_LINES:])


class Children:
    """Every process one demo run started; leaving the `with` block stops those still alive."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self._log_dir = log_dir
        self._env = env
        self._started: list[Child] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> Child:
        """Start `argv` in a new session (its own process group), output into `<name>.out/.err`."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        stdout_path = self._log_dir / f"{name}.out"
        stderr_path = self._log_dir / f"{name}.err"
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            process = subprocess.Popen(list(argv), stdout=out, stderr=err,
                                       env={**self._env, **(env or {})}, start_new_session=True)
        child = Child(name, process, stdout_path, stderr_path)
        self._started.append(child)
        return child

    def wait(self, children: Sequence[Child], *, timeout_s: float, step: str) -> None:
        """Wait until all `children` exit; raise `DemoError` naming the first failure (with the
        tail of its stderr) or the ones still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            failed = [c for c in children if c.process.poll() not in (None, 0)]
            if failed:
                first = failed[0]
                raise DemoError(f"{step}: {first.name} exited with status "
                                f"{first.process.returncode}:\n{first.stderr_tail()}")
            running = [c.name for c in children if c.process.poll() is None]
            if not running:
                return
            if time.monotonic() > deadline:
                raise DemoError(f"{step}: {', '.join(running)} still running after "
                                f"{timeout_s:g} s", hint="rerun with --keep and read the logs")
            time.sleep(0.1)

    def stop_all(self) -> None:
        """SIGTERM every live process group, then SIGKILL what is left after a grace period."""
        live = [c for c in self._started if c.process.poll() is None]
        for child in live:
            _signal_group(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for child in live:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.process.pid, signal.SIGKILL)
                child.process.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `KeyboardInterrupt`, so cleanup runs as for Ctrl-C."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
