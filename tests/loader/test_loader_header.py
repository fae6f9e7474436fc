"""Safetensors header validation: what a real file parses to, and the exact error for each
malformed kind."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from dlo_contract.safetensors_header import HeaderError, read_header
from safetensors.numpy import save_file

NAME = "s3://models/x/model.safetensors"
PREFIX = f"{NAME}: invalid safetensors header: "


def st_bytes(header: dict | str, data: bytes, *, length: int | None = None) -> bytes:
    raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def f32(name_offsets: dict[str, tuple[int, int]], count: int = 2) -> dict:
    return {name: {"dtype": "F32", "shape": [count], "data_offsets": list(offsets)}
            for name, offsets in name_offsets.items()}


def test_real_file_parses_with_every_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros((3, 4), np.float32), "b": np.ones(5, np.float16),
               "empty": np.zeros(0, np.int64)}, str(path), metadata={"format": "pt"})
    header = read_header(path, NAME)
    assert {(t.name, t.dtype, t.shape) for t in header.tensors} == {
        ("a", "F32", (3, 4)), ("b", "F16", (5,)), ("empty", "I64", (0,))}
    assert header.metadata == {"format": "pt"}
    assert header.data_start + max(t.end for t in header.tensors) == path.stat().st_size


MALFORMED = {
    "too-short": (b"\x01\x02", "file is 2 bytes; a safetensors file starts with an 8-byte "
                               "header length"),
    "huge-length": (struct.pack("<Q", 1 << 40) + b"{}",
                    "header length field is 1099511627776; expected 2 to 100000000"),
    "length-past-end": (st_bytes("{}", b"", length=1000),
                        "header length field is 1000 but only 2 bytes follow it"),
    "not-json": (st_bytes("{not json", b""),
                 "header is not valid JSON: Expecting property name enclosed in double quotes "
                 "at byte 1"),
    "not-utf8": (st_bytes("{}", b"")[:8] + b"\xff\xfe", "header is not UTF-8 (byte 0)"),
    "not-object": (st_bytes("[1, 2]", b""), "header is a JSON list; expected an object"),
    "duplicate": (st_bytes('{"a": 1, "a": 2}', b""), "header names 'a' twice"),
    "bad-dtype": (st_bytes({"w": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}}, b"x" * 8),
                  "tensor 'w' has dtype 'F12'; expected one of BF16, BOOL, C64, F16, F32, F4, "
                  "F64, F6_E2M3, F6_E3M2, F8_E4M3, F8_E5M2, F8_E8M0, I16, I32, I64, I8, U16, "
                  "U32, U64, U8"),
    "missing-field": (st_bytes({"w": {"dtype": "F32", "shape": [2]}}, b"x" * 8),
                      "tensor 'w' lacks data_offsets"),
    "negative-shape": (st_bytes({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                                b"x" * 8),
                       "tensor 'w' has shape [-2]; expected a list of integers >= 0"),
    "reversed-offsets": (st_bytes(f32({"w": (8, 0)}), b"x" * 8),
                         "tensor 'w' has data_offsets [8, 0]; expected [begin, end] with "
                         "0 <= begin <= end"),
    "size-disagrees": (st_bytes(f32({"w": (0, 8)}, count=3), b"x" * 8),
                       "tensor 'w' (F32, shape [3]) needs 12 bytes but its data_offsets [0, 8] "
                       "span 8"),
    "overlap": (st_bytes(f32({"a": (0, 8), "b": (4, 12)}), b"x" * 12),
                "tensors 'a' and 'b' overlap at data bytes 4-7"),
    "hole": (st_bytes(f32({"a": (0, 8), "b": (12, 20)}), b"x" * 20),
             "data bytes 8-11 belong to no tensor (before 'b')"),
    "past-end": (st_bytes(f32({"a": (0, 8)}), b"x" * 4),
                 "tensor 'a' ends at data byte 8 but the data area holds 4 bytes"),
    "trailing-bytes": (st_bytes(f32({"a": (0, 8)}), b"x" * 12),
                       "tensors end at data byte 8 but the data area holds 12 bytes (file size "
                       "disagrees with the header)"),
    "bad-metadata": (st_bytes({"__metadata__": {"k": 1}}, b""),
                     "__metadata__ must map strings to strings"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_header_is_named(kind: str, tmp_path: Path) -> None:
    data, problem = MALFORMED[kind]
    path = tmp_path / "m.safetensors"
    path.write_bytes(data)
    with pytest.raises(HeaderError) as caught:
        read_header(path, NAME)
    assert str(caught.value) == PREFIX + problem
    assert caught.value.hint == (
        "re-upload the object from a known-good copy (safetensors.torch.save_file)")


def test_sub_byte_dtypes_count_bits(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(st_bytes({"q": {"dtype": "F4", "shape": [6], "data_offsets": [0, 3]}}, b"abc"))
    assert read_header(path, NAME).tensors[0].end == 3
