"""Errors of the control plane, split by what the caller does next.

`SpecError` means the DOD spec must change (the handler reports `Valid=False` and creates
nothing); `KubeTransientError` means the API server was busy or conflicting (kopf retries after
`delay_s`); `KubeError` is any other API refusal (RBAC, a malformed object), reported once.
Raised by `spec` and `kube`; caught by `handlers` and the CLI.
"""

from __future__ import annotations

from dlo_contract.errors import DloError, PermanentError, TransientError


class OperatorError(DloError):
    """Base of every error the operator raises on purpose."""


class SpecError(OperatorError, PermanentError):
    """The DiffusionOffloadDeployment spec cannot be turned into a valid settings document."""


class KubeError(OperatorError, PermanentError):
    """The Kubernetes API refused a request and retrying will not change its answer."""

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        """The HTTP status the API answered (404 lets a reader treat the object as gone)."""


class KubeTransientError(OperatorError, TransientError):
    """The Kubernetes API was throttling, unavailable or reported a conflict: retry later."""


class NameConflict(OperatorError, PermanentError):
    """A child's name is taken by an object another DOD (or controller) controls: the operator
    writes none of the DOD's children until the name is free (rechecked on every reconcile)."""
