"""Imported by every Python process started with this folder first on `PYTHONPATH` (`site`
imports `sitecustomize` at start-up); it does nothing unless `HOLD_ENV` is set.

A test sets `HOLD_ENV` to `<Group method>:<call number>:<marker path>` for one loader of a group
(`loader_fleet.Fleet.start(..., hold=...)`): that loader's `group.Group.<method>` creates the
marker file and then blocks for good at its call of that number, its heartbeat still beating, so
the others wait for it in that collective (a chunk round: `all_gather_into`; the plan's agreement,
the checks' comparison or the survivors' re-plan: `all_gather_object`) until the test, which
waited for the marker, kills it. A point in the fill reached for certain, not guessed from time.
"""

from __future__ import annotations

import os

HOLD_ENV = "DLO_TEST_HOLD"

if os.environ.get(HOLD_ENV):
    import itertools
    import threading
    from pathlib import Path

    from dlo_loader import group

    _method, _number, _marker = os.environ[HOLD_ENV].split(":", 2)
    _original = getattr(group.Group, _method)
    _calls = itertools.count(1)

    def _held(self: group.Group, *args: object, **kwargs: object) -> object:
        if next(_calls) == int(_number):
            Path(_marker).touch()
            threading.Event().wait()  # held until the test kills this loader
        return _original(self, *args, **kwargs)

    setattr(group.Group, _method, _held)
