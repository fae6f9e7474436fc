"""The runtime's errors form one tree under `OffloadError`, defined in one module, and stay
importable where users found them."""

from __future__ import annotations

import importlib
import pkgutil

import dlo_runtime
import pytest

from dlo_contract.errors import PermanentError
from dlo_runtime import errors
from dlo_runtime.errors import OffloadError


def _runtime_modules() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(dlo_runtime.__path__,
                                                              prefix="dlo_runtime."))


def test_every_runtime_error_is_defined_in_errors_under_offload_error() -> None:
    found = {}
    for name in _runtime_modules():
        for value in vars(importlib.import_module(name)).values():
            if (isinstance(value, type) and issubclass(value, BaseException)
                    and value.__module__.startswith("dlo_runtime")):
                found[value.__name__] = value
    assert {cls.__module__ for cls in found.values()} == {"dlo_runtime.errors"}
    assert all(issubclass(cls, OffloadError) for cls in found.values())
    assert issubclass(OffloadError, PermanentError)
    assert len(found) == 12  # the eleven the runtime raised before, and HostMemoryError


def test_the_tree_keeps_what_callers_catch_by() -> None:
    assert issubclass(errors.RuntimeCacheMismatch, errors.MappingError)
    for cls in (errors.PinnedMemoryError, errors.PlatformCallError, errors.RegistrationError):
        assert issubclass(cls, errors.HostMemoryError)
    assert issubclass(errors.SlotStateError, RuntimeError)
    assert issubclass(errors.NoStatistics, LookupError)
    assert errors.PlatformCallError("cudaHostRegister failed", code=2).code == 2


@pytest.mark.parametrize(("module", "name"), [
    ("dlo_runtime.tensors", "OffloadError"), ("dlo_runtime.pod", "PodError"),
    ("dlo_runtime.entry_file", "PodError"), ("dlo_runtime.offload_plan", "OffloadPlanError"),
    ("dlo_runtime.host_weight_plan", "HostPlanError"), ("dlo_runtime.mapping", "MappingError"),
    ("dlo_runtime.runtime_weight_cache", "RuntimeCacheMismatch"),
    ("dlo_runtime.pinned_arena", "PinnedMemoryError"),
    ("dlo_runtime.cuda_registration", "PlatformCallError"),
    ("dlo_runtime.host_registration", "RegistrationError"),
    ("dlo_runtime.slots", "SlotStateError"), ("dlo_runtime.metrics", "NoStatistics"),
])
def test_public_names_stay_importable_where_users_import_them(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)
