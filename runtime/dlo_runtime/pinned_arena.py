"""Page-locked host arenas of exactly the size asked for, through the registration backend.

Owns `PinnedHostMemory`, which the streams use for every host arena on CUDA (the shards of
AllGather mode, the packed blocks of rank-local mode, the staging slots): anonymous,
page-aligned memory mapped at the requested size rounded up to one page, registered with the
device runtime through the same platform backend as mapped cache pages
(`cuda_registration.CudaRegistrationBackend`, writable this time: the host fills the arenas), and
checked to report pinned. PyTorch's caching host allocator (`pin_memory=True`) would round each
arena up to the next power of two (up to 2x the plan's bytes); here pinned host bytes equal the
plan's bytes within a page per arena. The pages are unregistered, then unmapped, when the last
tensor viewing them is freed. Called by `dlo_runtime.streams`; it must not decide what to
allocate nor call the device runtime except through the backend.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

from dlo_contract.errors import PermanentError
from dlo_runtime.host_registration import PAGE, PlatformBackend
from dlo_runtime.errors import PinnedMemoryError

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_round(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages (at least one)."""
    return max(1, -(-nbytes // PAGE)) * PAGE


class _Pages:
    """Owns one registered mapping; freed with the buffer object the tensors keep alive."""

    def __init__(self, address: int, length: int, backend: PlatformBackend) -> None:
        self.address, self.length, self.backend = address, length, backend

    def __del__(self) -> None:
        try:
            self.backend.unregister(self.address)
        except PermanentError as exc:
            # Unmapping pages the device runtime still owns would be unsafe: keep them.
            logger.error("pinned arena at %#x (%d bytes) could not be unregistered, keeping it "
                         "mapped: %s", self.address, self.length, exc)
            return
        _libc.munmap(self.address, self.length)


class PinnedHostMemory:
    """Allocates page-locked host tensors of exactly the requested size (within a page)."""

    def __init__(self, backend: PlatformBackend) -> None:
        self.backend = backend
        self.pinned_bytes = 0
        """Bytes page-locked by this allocator so far (arenas are never reused)."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized (zero-filled by the kernel) page-locked host tensor."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        nbytes = numel * dtype.itemsize
        length = page_round(nbytes)
        address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if address in (None, _MAP_FAILED):
            raise PinnedMemoryError(
                f"mmap of {length} bytes for a pinned host arena failed: "
                f"errno {ctypes.get_errno()}", hint="the node is out of host memory")
        try:
            self.backend.register(address, length)
        except PermanentError as exc:
            _libc.munmap(address, length)
            raise PinnedMemoryError(
                f"page-locking a host arena of {length} bytes failed: {exc}",
                hint="raise the pod's memory limit or the locked-memory limit (ulimit -l)",
            ) from exc
        pages = _Pages(address, length, self.backend)
        if not self.backend.reports_pinned(address):
            del pages  # unregisters and unmaps
            raise PinnedMemoryError(
                f"a host arena of {length} bytes does not report pinned after registration",
                hint="check the device runtime; copies from it would not be asynchronous")
        buffer = (ctypes.c_uint8 * length).from_address(address)
        buffer._dlo_pages = pages  # type: ignore[attr-defined]  # freed with the last view
        self.pinned_bytes += length
        return torch.frombuffer(buffer, dtype=dtype, count=numel)


def cuda_pinned_memory(device: torch.device) -> PinnedHostMemory:
    """The allocator of the streams on a CUDA device."""
    from dlo_runtime.cuda_registration import CudaRegistrationBackend

    return PinnedHostMemory(CudaRegistrationBackend(device.index or 0, read_only=False))
