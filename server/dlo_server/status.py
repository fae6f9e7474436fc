"""Where the server stands, as the startup, readiness and liveness probes report it.

Owns the states and what each probe answers in each: the loader still filling (`filling`) or the
model being built (`loading`) is "not started yet", not "broken"; a broken server (a failed
start, a rank gone, a failed wave) fails every probe so that the kubelet restarts it. Pure.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class State(enum.Enum):
    JOINING = "joining"    # rendezvous of the group's ranks
    FILLING = "filling"    # the loader has not published the entry yet
    LOADING = "loading"    # building the DiT, enabling DLO, loading the VAE
    READY = "ready"
    STOPPING = "stopping"  # SIGTERM: queued requests finish, no new ones
    BROKEN = "broken"


class Probe(enum.Enum):
    STARTUP = "startup"
    READINESS = "ready"
    LIVENESS = "live"


_PASSES = {
    Probe.STARTUP: {State.READY, State.STOPPING},
    Probe.READINESS: {State.READY},
    Probe.LIVENESS: {State.JOINING, State.FILLING, State.LOADING, State.READY, State.STOPPING},
}


@dataclass(frozen=True)
class Answer:
    code: int
    state: State
    detail: str


class Status:
    """The current state and a line saying why; set from the engine thread, read by HTTP."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = State.JOINING
        self._detail = "joining the group"

    def set(self, state: State, detail: str) -> None:
        with self._lock:
            if self._state is State.BROKEN:  # broken stays broken: the kubelet restarts it
                return
            self._state, self._detail = state, detail

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    def probe(self, probe: Probe) -> Answer:
        """200 when `probe` passes; 500 when broken; else 503 (not yet, or stopping)."""
        with self._lock:
            state, detail = self._state, self._detail
        if state in _PASSES[probe]:
            return Answer(200, state, detail)
        return Answer(500 if state is State.BROKEN else 503, state, detail)
