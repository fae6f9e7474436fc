"""The runtime's errors: one tree under `OffloadError`, split by what the caller does next.

Owns every error class the runtime raises on purpose. `OffloadError` is the runtime's branch of
the shared `PermanentError` (a person must change the settings, the model, the entry or the
machine; retrying the same call will not help), so a server catches the runtime's errors with
one `except OffloadError`. The modules that raise them import them from here and keep them
importable where users found them (`dlo_runtime.pod.PodError`, `dlo_runtime.tensors.OffloadError`).
Imports nothing but the shared base; must not grow behaviour.

    PermanentError (dlo_contract.errors)
    └── OffloadError            DLO cannot be enabled on this model, group or host plan as given
        ├── PodError            the pod cannot start offloading as configured (entry file, wait)
        ├── OffloadPlanError    a model's offload plan is malformed or names missing modules
        ├── HostPlanError       a host weight plan used against its contract
        ├── MappingError        an entry's file is not a readable safetensors file
        │   └── RuntimeCacheMismatch   a mapped runtime entry differs from the ordinary tensors
        ├── HostMemoryError     host memory could not be allocated, pinned or registered
        │   ├── PinnedMemoryError      allocation or page-locking failed
        │   ├── PlatformCallError      one device-runtime call failed (its `code`)
        │   └── RegistrationError      registered pages could not be released: stop the process
        ├── SlotStateError      an illegal slot transition: a bug in the scheduler (a RuntimeError)
        └── NoStatistics        a closed handle has no statistics (a LookupError: collectors
                                report nothing instead of failing the scrape)
"""

from __future__ import annotations

from dlo_contract.errors import PermanentError


class OffloadError(PermanentError):
    """DLO cannot be enabled on this model, group or host plan as given: the base of every
    error the runtime raises on purpose."""


class PodError(OffloadError):
    """The process cannot start offloading as configured."""


class OffloadPlanError(OffloadError):
    """A model's offload plan is malformed or names modules the model does not have."""


class HostPlanError(OffloadError):
    """A plan was used against its contract (taken twice, never consumed, unsafe to close)."""


class MappingError(OffloadError):
    """A file of the entry is not a readable safetensors file."""


class RuntimeCacheMismatch(MappingError):
    """A mapped runtime entry's tensors differ from the ordinary ones they should equal."""


class HostMemoryError(OffloadError):
    """Host memory could not be allocated, page-locked or registered with the device runtime."""


class PinnedMemoryError(HostMemoryError):
    """Host memory could not be allocated or page-locked."""


class PlatformCallError(HostMemoryError):
    """One CUDA runtime call failed; `code` is the `cudaError_t`."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class RegistrationError(HostMemoryError):
    """Registered pages could not be released; the process must not unmap them or go on."""


class SlotStateError(OffloadError, RuntimeError):
    """An illegal slot transition: a bug in the scheduler, never a user error."""


class NoStatistics(OffloadError, LookupError):
    """What a `stats` callable raises once its source is gone (`OffloadHandle.close()`): the
    collector then reports no series, where any other error would fail the whole scrape."""
