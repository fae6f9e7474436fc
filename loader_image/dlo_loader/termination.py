"""What SIGTERM means to `dlo cache fill`: during the fill, a failure that cleans up; after it,
the end of the sidecar's stay.

Owns the process's SIGTERM (and, once the fill has ended, SIGINT) handling and the exit status of
a fill that SIGTERM ended (`EXIT_TERMINATED`). `cli` installs it first thing, before the
settings are read or a byte is fetched, so no SIGTERM ever finds the default handler (which
ends the process at once). Must not decide anything about the fill.

[Note: SIGTERM mid-fill] The kubelet sends SIGTERM when it deletes the pod, and SIGKILL after
the grace period. During the fill the handler raises `Terminated` in the main thread, once,
wherever it waits (every wait of a fill polls or can be interrupted), so the fill unwinds the
way a failure does: the readers stop (`Exchange.run`), the publication removes its temporary
directory and its preallocated files and releases its `.publish` lock and its room reservation
(`Publication.__exit__`), and a member of a fill group posts that it left and why (`Group.close`,
so the others name it at once). `cli` then writes the summary (status `error`) to stdout and
the termination message and exits with `EXIT_TERMINATED`. `Terminated` is a `BaseException`, so
no `except Exception` on the way takes it for an error of its own. Once the fill has ended,
SIGTERM and SIGINT only end the sidecar's stay (`stop`), and it exits with status 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

EXIT_TERMINATED = 128 + signal.SIGTERM
"""Exit status of a fill that SIGTERM ended (143: what a shell reports for a process SIGTERM
ended), after its summary and termination message; a fill that failed exits with 1."""
TERMINATED_MESSAGE = ("terminated by SIGTERM during the fill (the pod is being deleted); nothing "
                      "was published and the fill's temporary files were removed")


class Terminated(BaseException):
    """SIGTERM arrived during the fill (see [Note: SIGTERM mid-fill])."""

    def __init__(self) -> None:
        super().__init__(TERMINATED_MESSAGE)


class Termination:
    """This process's handlers; `install` as early as possible, `uninstall` when `run` ends (a
    process may run the command more than once, as the tests do)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        """Set by SIGTERM or SIGINT once the fill has ended: the sidecar stops staying up."""
        self._filling = True
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take SIGTERM (signal handlers belong to the main thread: elsewhere, do nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)

    def filled(self) -> None:
        """The fill has ended: from now on SIGTERM and SIGINT end the stay, nothing else."""
        self._filling = False
        if self._previous and signal.SIGINT not in self._previous:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._filling:
            self._filling = False  # once: a second SIGTERM must not cut the cleanup short
            raise Terminated()
        self.stop.set()


@contextlib.contextmanager
def installed() -> Iterator[Termination]:
    termination = Termination()
    termination.install()
    try:
        yield termination
    finally:
        termination.uninstall()
