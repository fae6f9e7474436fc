"""The one parser of safetensors headers, shared by the loader and the runtime.

Owns the format's rules as the reference implementation enforces them: an 8-byte little-endian
header length within bounds, a UTF-8 JSON object, known dtypes, non-negative shapes, data offsets
that each match their tensor's byte size, lie inside the file, neither overlap nor leave holes,
and end exactly where the file ends. Every error names the object and the problem, so a bad
upload is found by the loader before publication, not later by an inference server. Called by the
loader's `fill` on the filled (unpublished) files and by `dlo_runtime.mapping` before it maps a
file. A contract module: it must not read tensor data or import torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from dlo_contract.errors import PermanentError


class HeaderError(PermanentError):
    """A safetensors file's header is malformed; the message names the file and the problem."""


MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's limit; a larger length field means a corrupt file."""
LENGTH_BYTES = 8
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `begin`/`end` are offsets into the data area (after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    header_bytes: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return LENGTH_BYTES + self.header_bytes


def read_header(path: str | os.PathLike[str], name: str) -> Header:
    """Read and validate the header of the local file `path` (reported as object `name`)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        length = header_length(name, handle.read(LENGTH_BYTES), size)
        return parse_header(name, handle.read(length), size)


def header_length(name: str, first: bytes, file_size: int) -> int:
    """The declared header length, checked against the format limit and the file size."""
    if file_size < LENGTH_BYTES or len(first) < LENGTH_BYTES:
        raise _error(name, f"file is {file_size} bytes; a safetensors file starts with an "
                           f"{LENGTH_BYTES}-byte header length")
    (length,) = struct.unpack("<Q", first[:LENGTH_BYTES])
    if length < 2 or length > MAX_HEADER_BYTES:
        raise _error(name, f"header length field is {length}; expected 2 to {MAX_HEADER_BYTES}")
    if LENGTH_BYTES + length > file_size:
        raise _error(name, f"header length field is {length} but only "
                           f"{file_size - LENGTH_BYTES} bytes follow it")
    return int(length)


def parse_header(name: str, raw: bytes, file_size: int) -> Header:
    """Decode and check the JSON header `raw` of an object of `file_size` bytes."""
    data = _decode(name, raw)
    metadata = _metadata(name, data.pop("__metadata__", None))
    tensors = [_tensor(name, key, value) for key, value in data.items()]
    _check_layout(name, tensors, file_size - LENGTH_BYTES - len(raw))
    return Header(header_bytes=len(raw), tensors=tuple(tensors), metadata=metadata)


def _decode(name: str, raw: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise _error(name, f"header names {key!r} twice")
            result[key] = value
        return result

    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except UnicodeDecodeError as exc:
        raise _error(name, f"header is not UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise _error(name, f"header is not valid JSON: {exc.msg} at byte {exc.pos}") from exc
    if not isinstance(data, dict):
        raise _error(name, f"header is a JSON {type(data).__name__}; expected an object")
    return data


def _metadata(name: str, value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _error(name, "__metadata__ must map strings to strings")
    return value


def _tensor(name: str, key: str, value: Any) -> TensorInfo:
    where = f"tensor {key!r}"
    if not isinstance(value, dict):
        raise _error(name, f"{where} is not an object")
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in value]
    if missing:
        raise _error(name, f"{where} lacks {', '.join(missing)}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise _error(name, f"{where} has dtype {dtype!r}; expected one of "
                           f"{', '.join(sorted(DTYPE_BITS))}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _error(name, f"{where} has shape {shape!r}; expected a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise _error(name, f"{where} has data_offsets {offsets!r}; expected [begin, end] "
                           "with 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    span = offsets[1] - offsets[0]
    if bits % 8 or bits // 8 != span:
        raise _error(name, f"{where} ({dtype}, shape {shape}) needs {bits / 8:g} bytes but its "
                           f"data_offsets {offsets} span {span}")
    return TensorInfo(key, dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(name: str, tensors: list[TensorInfo], data_bytes: int) -> None:
    """Tensors must tile the data area exactly: no overlap, no hole, no byte past the end."""
    position, previous = 0, None
    for tensor in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if tensor.begin < position:
            raise _error(name, f"tensors {previous!r} and {tensor.name!r} overlap at data "
                               f"bytes {tensor.begin}-{position - 1}")
        if tensor.begin > position:
            raise _error(name, f"data bytes {position}-{tensor.begin - 1} belong to no tensor "
                               f"(before {tensor.name!r})")
        if tensor.end > data_bytes:
            raise _error(name, f"tensor {tensor.name!r} ends at data byte {tensor.end} but the "
                               f"data area holds {data_bytes} bytes")
        position, previous = tensor.end, tensor.name
    if position != data_bytes:
        raise _error(name, f"tensors end at data byte {position} but the data area holds "
                           f"{data_bytes} bytes (file size disagrees with the header)")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _error(name: str, problem: str) -> HeaderError:
    return HeaderError(
        f"{name}: invalid safetensors header: {problem}",
        hint="re-upload the object from a known-good copy (safetensors.torch.save_file)",
    )
