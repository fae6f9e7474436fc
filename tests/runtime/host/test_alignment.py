"""Compute sees the alignment a resident model has, whatever the checkpoint's offsets.

CPU matmul kernels may round differently when an operand does not start on a 64-byte boundary
(AVX-512 kernels do), so a test that compares bits with the resident model holds on every CPU
only if no weight reaches compute at an alignment a fresh allocation would not have. These tests
assert that alignment itself, so they fail on any machine when the rule breaks, not only on the
CPUs whose kernels notice ([Note: compute alignment] in `dlo_runtime.transfer`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from support.host_helpers import publish_checkpoint, rank_local, write_entry_file
from torch import nn

from dlo_bench.models import example_inputs, save_skewed_layout
from dlo_contract import names
from dlo_runtime import pod
from dlo_runtime.layout import ALIGN_BYTES
from dlo_runtime.mapping import read_header
from dlo_runtime.offload_plan import weight_bytes


@pytest.fixture(params=[8, 0], ids=["skewed-8", "aligned"])
def skewed_entry(request: pytest.FixtureRequest, tmp_path: Path, flux: nn.Module,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[Path, int]:
    """A published checkpoint whose every tensor lies `skew` bytes off a 64-byte boundary."""
    skew = request.param
    save_skewed_layout(flux, tmp_path / "layout", skew)
    root = tmp_path / "cache"
    entry = publish_checkpoint(root, tmp_path / "layout")
    monkeypatch.setenv(names.ENTRY_FILE_ENV, str(write_entry_file(tmp_path, entry)))
    document = tmp_path / "settings.json"
    document.write_text(rank_local(root).to_json())
    monkeypatch.setenv(names.CONFIG_ENV, str(document))
    return Path(entry["path"]), skew


def watch_compute_alignment(dit: nn.Module) -> list[str]:
    """Names of the weights that a module's forward starts with off `ALIGN_BYTES`, recorded
    from pre-hooks installed after dlo's (so a streamed block's weights are already in place)."""
    misaligned: list[str] = []
    for path, module in dit.named_modules():
        def check(module: nn.Module, args: object, path: str = path) -> None:
            for name, tensor in [*module.named_parameters(recurse=False),
                                 *module.named_buffers(recurse=False)]:
                if tensor.numel() and tensor.data_ptr() % ALIGN_BYTES:
                    misaligned.append(f"{path}.{name}")
        module.register_forward_pre_hook(check)
    return misaligned


def test_a_checkpoint_off_the_alignment_reaches_compute_aligned_and_matches_the_resident_model(
        skewed_entry: tuple[Path, int], flux: nn.Module) -> None:
    entry, skew = skewed_entry
    offsets = [stored.offset for file in sorted(entry.rglob("*.safetensors"))
               for stored in read_header(file).values()]
    assert len(offsets) == len(flux.state_dict()) and {o % ALIGN_BYTES for o in offsets} == {skew}
    dit = pod.build_dit(FluxTransformer2DModel)
    handle = pod.enable(dit, device="cpu")
    try:
        misaligned = watch_compute_alignment(dit)
        with torch.no_grad():
            resident = flux(**example_inputs("flux", flux))[0]
            for _ in range(2):  # the first forward loads every block; the second reuses a slot
                assert torch.equal(dit(**example_inputs("flux", flux))[0], resident)
        assert misaligned == []
        streamed_bytes = round(handle.streamed_share * weight_bytes(flux))
        stats = handle.stats().last_forward
        # Misaligned views are copied into the slots at each load; aligned ones are used where
        # the mapping holds them, with no slot memory at all.
        assert stats.blocks_loaded == handle.stats().streamed_blocks
        assert (stats.bytes_h2d, handle.slot_bytes > 0) == ((streamed_bytes, True) if skew
                                                            else (0, False))
    finally:
        handle.close()
