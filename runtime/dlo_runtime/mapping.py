"""Read-only shared mappings of the safetensors files of one cache entry, and zero-copy views.

Owns the `mmap` objects of an entry and the entry's `.use` lock (through the `EntryHandle` the
caller opened), turns the headers `safetensors_header` checked into mappable tensor records,
and writes the runtime entry's files (`write_safetensors`). Called by `checkpoint_plan` and
`runtime_weight_cache`; the resulting `MappedEntry` is the `MappedSource` of a `HostWeightPlan`.

Every process on a node that maps the same file shares its page-cache pages, which is the point
of the node cache. The mappings are `PROT_READ`: a write through a view faults, so consumers must
copy, never modify in place. `close()` drops this module's references and never unmaps under a
live view: each view's storage holds its `mmap`, so the kernel mapping ends with the last view
(unmapping earlier would turn a later read into a crash).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlo_contract import safetensors_header
from dlo_runtime.host_weight_plan import TensorBinding
from dlo_runtime.layout import ALIGN_BYTES
from dlo_runtime.errors import MappingError


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class StoredTensor:
    """One tensor as a safetensors header describes it; `offset` is absolute in the file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file, after the shared parser has checked its header."""
    try:
        header = safetensors_header.read_header(path, str(path))
    except OSError as exc:
        raise MappingError(f"{path}: cannot read the safetensors header: {exc}") from exc
    except safetensors_header.HeaderError as exc:
        raise MappingError(str(exc)) from exc
    padding = set((header.metadata or {}).get(PADDING_KEY, "").split(","))
    stored = {}
    for tensor in header.tensors:
        if tensor.name in padding:
            continue
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise MappingError(f"{path}: tensor {tensor.name!r} has dtype {tensor.dtype}, which "
                               f"cannot be mapped; expected one of "
                               f"{', '.join(SAFETENSORS_DTYPES)}")
        stored[tensor.name] = StoredTensor(
            key=tensor.name, dtype=SAFETENSORS_DTYPES[tensor.dtype], shape=tensor.shape,
            offset=header.data_start + tensor.begin, nbytes=tensor.end - tensor.begin)
    return stored


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
PADDING_KEY = "dlo.padding"
"""`__metadata__` key of the files `write_safetensors` makes: the comma-separated names of the
U8 tensors that only pad the next tensor to its boundary ([Note: aligned files])."""


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write contiguous CPU `tensors` as one safetensors file straight from their memory (no
    serialized copy of the whole file in memory); returns the file size.

    [Note: aligned files] Every tensor's data starts at a multiple of `ALIGN_BYTES` in the
    file, so that a mapping (page-aligned) hands compute the alignment a fresh allocation has
    ([Note: compute alignment] in `dlo_runtime.transfer`) and no load has to copy. The header is
    padded with spaces, as the format allows, so the data area starts on that boundary; the
    format forbids holes between tensors, so a gap before a tensor is a padding tensor, named in
    the metadata under `PADDING_KEY` and left out by `read_header`."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {}
    pieces: list[torch.Tensor | int] = []
    padding: list[str] = []
    offset = 0
    for name in order:
        gap = -offset % ALIGN_BYTES
        if gap:
            padding.append(f"{PADDING_KEY}.{len(padding)}")
            header[padding[-1]] = {"dtype": "U8", "shape": [gap],
                                   "data_offsets": [offset, offset + gap]}
            pieces.append(gap)
            offset += gap
        tensor = tensors[name]
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        pieces.append(tensor)
        offset += tensor.nbytes
    if padding:
        header["__metadata__"] = {PADDING_KEY: ",".join(padding)}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGN_BYTES)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(encoded)) + encoded)
        for piece in pieces:
            if isinstance(piece, int):
                stream.write(bytes(piece))
            elif piece.nbytes:
                stream.write(piece.reshape(-1).view(torch.uint8).numpy().data)
    return 8 + len(encoded) + offset


class _MappedFile:
    """One file mapped `MAP_SHARED`/`PROT_READ`, with a byte view over all of it."""

    def __init__(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise MappingError(f"{path}: cannot open for mapping: {exc.strerror}") from exc
        try:
            self.length = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the file; the descriptor is not needed
        with warnings.catch_warnings():
            # torch warns that it cannot mark a tensor read-only. The pages are PROT_READ and
            # every consumer copies out of them, so the warning carries no information here.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)


class MappedEntry:
    """The safetensors files of one entry directory, mapped on first use."""

    def __init__(self, directory: Path, *, handle: Any = None) -> None:
        """`handle` is the open `EntryHandle` whose shared `.use` lock keeps eviction away
        while the mapping is in use; it is closed with the mapping."""
        self.directory = directory
        self._handle = handle
        self._files: dict[str, _MappedFile] = {}
        self._closed = False

    def view(self, binding: TensorBinding) -> torch.Tensor:
        """A zero-copy tensor over the binding's bytes."""
        mapped = self._file(binding.file)
        end = binding.offset + binding.nbytes
        if end > mapped.length:
            raise MappingError(f"{binding.file}: {binding.name!r} ends at byte {end}, past the "
                               f"file's {mapped.length} bytes")
        if binding.offset % binding.dtype.itemsize:
            raise MappingError(f"{binding.file}: {binding.name!r} starts at byte "
                               f"{binding.offset}, not aligned for {binding.dtype}")
        raw = mapped.bytes[binding.offset:end]
        return raw.view(binding.dtype).view(binding.shape)

    def close(self) -> None:
        """Drop the mappings (each lasts until its last view is freed) and the `.use` lock."""
        if self._closed:
            return
        self._closed = True
        self._files.clear()
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _file(self, name: str) -> _MappedFile:
        if self._closed:
            raise MappingError(f"{self.directory}: the mapping is closed")
        mapped = self._files.get(name)
        if mapped is None:
            mapped = self._files[name] = _MappedFile(self.directory / name)
        return mapped
