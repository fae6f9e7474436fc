"""The CUDA backend of host registration, and the project's only caller of the CUDA runtime.

Owns the `ctypes` calls into `libcudart`: `cudaDeviceGetAttribute` (is read-only registration
supported?), `cudaHostRegister` with `cudaHostRegisterReadOnly`, `cudaHostUnregister`, and
`cudaPointerGetAttributes` (the check PyTorch's `Tensor.is_pinned()` makes); the same calls,
without the read-only flag, page-lock the backend's host arenas (`pinned_arena`). `Cudart` is the
bottom layer; tests replace it, and only it, with a fake. `CudaRegistrationBackend` turns return
codes into `PlatformCallError`s for `host_registration`, which owns the lifecycle.

Must not decide what to register, keep state about ranges, or roll anything back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
from pathlib import Path

from dlo_runtime.errors import PlatformCallError


CUDA_SUCCESS = 0
HOST_REGISTER_PORTABLE = 0x01
"""Pinned for every CUDA context of the process, not only the current device's."""
HOST_REGISTER_READ_ONLY = 0x08
"""The device only reads the pages, so PROT_READ file mappings can be registered."""
DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113
MEMORY_TYPE_HOST = 1


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


def find_cudart() -> str:
    """Path of the `libcudart` PyTorch uses: one already loaded in this process, else the one
    beside torch's libraries or in the `nvidia-cuda-runtime` wheel, else the system's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcudart.so" in path:
                return path
    import torch

    torch_lib = Path(torch.__file__).parent / "lib"
    patterns = [str(torch_lib / "libcudart.so*"),
                str(torch_lib.parent.parent / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so*")]
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    system = ctypes.util.find_library("cudart")
    if system is None:
        raise PlatformCallError("libcudart not found beside torch or on the system", code=-1)
    return system


class Cudart:
    """Thin `ctypes` binding of the five CUDA runtime calls registration needs."""

    def __init__(self, path: str | None = None) -> None:
        # dlopen of a library already loaded by torch returns that same instance.
        self._lib = ctypes.CDLL(path or find_cudart())
        self._lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._lib.cudaDeviceGetAttribute.argtypes = [
            ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self._lib.cudaPointerGetAttributes.argtypes = [
            ctypes.POINTER(_PointerAttributes), ctypes.c_void_p]
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p

    def host_register(self, address: int, length: int, flags: int) -> int:
        return int(self._lib.cudaHostRegister(address, length, flags))

    def host_unregister(self, address: int) -> int:
        return int(self._lib.cudaHostUnregister(address))

    def device_attribute(self, attribute: int, device: int) -> tuple[int, int]:
        value = ctypes.c_int(0)
        code = int(self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device))
        return code, value.value

    def memory_type(self, address: int) -> tuple[int, int]:
        attributes = _PointerAttributes()
        code = int(self._lib.cudaPointerGetAttributes(ctypes.byref(attributes), address))
        return code, attributes.type

    def error_string(self, code: int) -> str:
        return (self._lib.cudaGetErrorString(code) or b"unknown error").decode()


class CudaRegistrationBackend:
    """Platform backend for `host_registration`: read-only, portable page locking on CUDA."""

    name = "cuda"

    def __init__(self, device_index: int, cudart: Cudart | None = None, *,
                 read_only: bool = True) -> None:
        self.device_index = device_index
        self._cudart = cudart if cudart is not None else Cudart()
        self.flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        """Read-only for mapped cache pages (PROT_READ); writable for host arenas the host
        fills (`dlo_runtime.pinned_arena`)."""

    def unsupported_reason(self) -> str | None:
        """Why this device cannot take read-only registrations, or None when it can."""
        code, value = self._cudart.device_attribute(
            DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, self.device_index)
        if code != CUDA_SUCCESS:
            return (f"cudaDeviceGetAttribute(HostRegisterReadOnlySupported) failed on device "
                    f"{self.device_index}: {self._cudart.error_string(code)}")
        if not value:
            return f"CUDA device {self.device_index} does not support read-only host registration"
        return None

    def register(self, address: int, length: int) -> None:
        code = self._cudart.host_register(address, length, self.flags)
        if code != CUDA_SUCCESS:
            raise PlatformCallError(
                f"cudaHostRegister({address:#x}, {length}) failed: "
                f"{self._cudart.error_string(code)}", code=code)

    def unregister(self, address: int) -> None:
        code = self._cudart.host_unregister(address)
        if code != CUDA_SUCCESS:
            raise PlatformCallError(
                f"cudaHostUnregister({address:#x}) failed: {self._cudart.error_string(code)}",
                code=code)

    def reports_pinned(self, address: int) -> bool:
        """Whether the runtime sees `address` as page-locked host memory (what
        `Tensor.is_pinned()` asks), so non-blocking copies from it are true DMA."""
        code, memory_type = self._cudart.memory_type(address)
        return code == CUDA_SUCCESS and memory_type == MEMORY_TYPE_HOST
