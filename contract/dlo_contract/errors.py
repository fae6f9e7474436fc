"""The error tree shared by the three planes.

Every plane raises subclasses of `DloError` so that the CLI, the operator and the loader can
decide what to do next from the class alone: a `TransientError` is worth retrying after its
`delay_s`; a `PermanentError` needs a change by a person (spec, data, disk) and is reported once.
Messages say what happened, the value, what was expected, and what to do.
"""

from __future__ import annotations


class DloError(Exception):
    """Base of every error this project raises on purpose."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class PermanentError(DloError):
    """Retrying will not help: the input, the data or the machine must change first."""


class TransientError(DloError):
    """A passing condition (lock contention, throttling, a conflict); retry after `delay_s`."""

    def __init__(self, message: str, *, delay_s: float = 1.0, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.delay_s = delay_s
