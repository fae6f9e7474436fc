"""The runtime weight cache in one process: publish, join, identity, and every fallback."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support.host_helpers import rank_local, settings_with, state_equal
from torch import nn

from dlo_contract.cache import CacheRoot, list_entries
from dlo_contract.cache.locks import lock
from dlo_runtime.host_weight_plan import BackingKind
from dlo_runtime.runtime_weight_cache import RuntimeLayout, load_runtime_plan


def cached(root: Path, **fields: object):
    return rank_local(root, **{"offload.enable_runtime_cache": True, **fields})


def test_first_process_publishes_and_the_next_joins(tmp_path: Path, flux: nn.Module) -> None:
    settings = cached(tmp_path)
    first = load_runtime_plan(flux, settings, RuntimeLayout())
    second = load_runtime_plan(flux, settings, RuntimeLayout())
    assert first.reason is None and first.published and not second.published
    assert first.entry_id == second.entry_id
    assert [e.entry_id for e in list_entries(tmp_path)] == [first.entry_id]
    assert first.plan.backing_kind is BackingKind.RUNTIME_CACHE
    assert not first.plan.sources_pinned
    assert state_equal(second.plan.take_tensors(), flux.state_dict())
    first.plan.close()
    second.plan.close()


def test_identity_keeps_tp_coordinates_and_sp_guards_apart(tmp_path: Path,
                                                           flux: nn.Module) -> None:
    settings = cached(tmp_path)
    ids = set()
    for layout in (RuntimeLayout(), RuntimeLayout(tp_size=2, tp_rank=1),
                   RuntimeLayout(sp_size=2, sp_impl="ulysses")):
        result = load_runtime_plan(flux, settings, layout)
        ids.add(result.entry_id)
        result.plan.close()
    assert len(ids) == 3


def test_off_keeps_ordinary_tensors(tmp_path: Path, flux: nn.Module) -> None:
    # With AllGather on, validation refuses the runtime cache (`runtime-cache-allgather`).
    assert load_runtime_plan(flux, rank_local(tmp_path), RuntimeLayout()).reason == (
        "the runtime cache is off (offload.enable_runtime_cache)")


def tied(model: nn.Module) -> nn.Module:
    model.x_embedder.weight = model.proj_out.weight
    return model


def transposed(model: nn.Module) -> nn.Module:
    model.proj_out.weight = nn.Parameter(model.proj_out.weight.detach().t().contiguous().t())
    return model


def aliased(model: nn.Module) -> nn.Module:
    model.proj_out.bias.data = model.proj_out.weight.data.reshape(-1)[:4]
    return model


def quantized(model: nn.Module) -> nn.Module:
    model.proj_out.weight.data = model.proj_out.weight.data.to(torch.float8_e4m3fn)
    return model


@pytest.mark.parametrize(("change", "reason"), [
    (tied, "layout not cacheable: tied parameters: 'x_embedder.weight' and 'proj_out.weight' "
           "are one tensor"),
    (transposed, "layout not cacheable: 'proj_out.weight' is not contiguous"),
    (aliased, "layout not cacheable: aliased tensors: 'proj_out.bias' and 'proj_out.weight' "
              "share storage"),
    (quantized, "layout not cacheable: 'proj_out.weight' is quantized (torch.float8_e4m3fn)"),
])
def test_unsupported_layouts_are_rejected_before_anything_changes(
        tmp_path: Path, flux: nn.Module, change, reason: str) -> None:
    model = change(copy.deepcopy(flux))
    before = {n: (t.data_ptr(), t.clone()) for n, t in model.state_dict(keep_vars=True).items()}
    result = load_runtime_plan(model, cached(tmp_path), RuntimeLayout())
    assert result.plan is None and result.reason == reason
    assert not CacheRoot(tmp_path).entries.exists() or list_entries(tmp_path) == []
    after = model.state_dict(keep_vars=True)
    assert all(after[n].data_ptr() == p and torch.equal(after[n], v)
               for n, (p, v) in before.items())


def test_lock_timeout_keeps_ordinary_tensors(tmp_path: Path, flux: nn.Module) -> None:
    settings = cached(tmp_path, **{"offload.runtime_cache_lock_timeout_s": 0.2})
    probe = load_runtime_plan(flux, cached(tmp_path / "probe"), RuntimeLayout())
    probe.plan.close()
    root = CacheRoot(tmp_path)
    root.ensure()
    held = lock(root.publish_lock(probe.entry_id), timeout_s=1)
    try:
        result = load_runtime_plan(flux, settings, RuntimeLayout())
    finally:
        held.release()
    assert result.plan is None and result.entry_id == probe.entry_id
    assert result.reason == (f"timed out after 0.2 s waiting for the publish lock "
                             f"{root.publish_lock(probe.entry_id)}")


def test_corrupted_entry_is_detected_after_mapping(tmp_path: Path, flux: nn.Module) -> None:
    settings = cached(tmp_path)
    first = load_runtime_plan(flux, settings, RuntimeLayout())
    first.plan.close()
    corrupt_last_byte(tmp_path, first.entry_id)
    again = load_runtime_plan(flux, settings, RuntimeLayout())
    assert again.plan is None
    assert again.reason == (f"runtime cache entry {first.entry_id} does not hold this process's "
                            "tensors (content digest mismatch after mapping)")


def corrupt_last_byte(root: Path, entry_id: str) -> None:
    """Flip the last byte of the entry's first file, keeping its size (so only content checks
    can notice)."""
    path = sorted(CacheRoot(root).entry_dir(entry_id).glob("*.safetensors"))[0]
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
