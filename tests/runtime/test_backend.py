"""The DLO backend in one process (rank-local mode) on the CPU: offloaded forwards equal the
resident model bit for bit, for the diffusers DiTs and for models that declare their own plan."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from support.runtime_helpers import RANK_LOCAL, forward, offload_settings, run_case
from support.runtime_models import DeclaredDiT, UndeclaredDiT, seeded

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.offload_plan import OffloadPlanError
from dlo_contract.settings import Settings, SettingsError
from dlo_contract.validation import names_for
from dlo_runtime.tensors import OffloadError
from dlo_runtime.transfer import ShardStore


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_rank_local_forward_equals_resident_forward(kind: str) -> None:
    outcome = run_case(kind, RANK_LOCAL)
    assert (outcome.equal, outcome.equal_second_step, outcome.equal_after_disable) == (
        True, True, True,
    )
    assert outcome.mode == "rank-local"
    assert outcome.slot_bytes == 2 * outcome.largest_block_bytes
    assert outcome.largest_block_bytes <= outcome.largest_block_tensor_bytes * 1.02
    assert outcome.streamed_bytes <= outcome.host_bytes <= outcome.streamed_bytes * 1.02
    assert outcome.shard_storages == outcome.shard_dtypes == 1


def test_every_block_of_a_dtype_is_packed_in_one_host_arena() -> None:
    """Mixed dtypes: one storage per dtype holds every block, at aligned offsets, counted once."""
    model = tiny_model("wan", dtype=torch.bfloat16)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        source = backend._source
        assert isinstance(source, ShardStore)
        arena = {flat.dtype: flat for flat in source.host_tensors()}
        assert list(arena) == [torch.bfloat16, torch.float32]
        for dtype, flat in arena.items():
            shards = [block[dtype] for block in source.shards]
            assert len(shards) == 3
            assert {s.untyped_storage().data_ptr() for s in shards} == {
                flat.untyped_storage().data_ptr()
            }
            assert all(s.data_ptr() % 64 == 0 for s in shards)
            assert sum(s.numel() for s in shards) == flat.numel()
        assert host_bytes(backend.host_tensors()) == sum(
            flat.numel() * flat.element_size() for flat in arena.values()
        )
    outcome = run_case("wan", RANK_LOCAL, dtype=torch.bfloat16)
    assert outcome.shard_storages == outcome.shard_dtypes == 2


def test_blocks_of_mixed_dtypes_stream_exactly() -> None:
    """Wan in bfloat16 keeps its norms and modulation tables in float32 inside every block."""
    model = tiny_model("wan", dtype=torch.bfloat16)
    assert {p.dtype for p in model.blocks[0].parameters()} == {torch.bfloat16, torch.float32}
    outcome = run_case("wan", RANK_LOCAL, dtype=torch.bfloat16)
    assert (outcome.equal, outcome.equal_second_step) == (True, True)


@pytest.mark.parametrize("layers", [1, 3, 7])
def test_odd_block_counts(layers: int) -> None:
    outcome = run_case("flux", RANK_LOCAL, num_layers=layers)
    assert (outcome.equal, outcome.equal_second_step, outcome.equal_after_disable) == (
        True, True, True,
    )


def test_resident_leading_layers_stay_on_the_device_and_the_rest_stream() -> None:
    reference = tiny_model("flux")
    inputs = example_inputs("flux", reference)
    expected = forward(reference, inputs)
    model = tiny_model("flux")
    settings = offload_settings(use_allgather=False, resident_layers=2)
    with DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu") as backend:
        assert [layout.path for layout in backend.layouts] == [
            "single_transformer_blocks.0", "single_transformer_blocks.1",
            "single_transformer_blocks.2",
        ]
        assert torch.equal(forward(model, inputs), expected)
        assert all(p.numel() > 0 for p in model.transformer_blocks.parameters())
        assert all(p.numel() == 0 for p in model.single_transformer_blocks.parameters())


def test_streamed_parameters_keep_their_objects_and_hold_placeholders_between_steps() -> None:
    model = tiny_model("sd3")
    before = {name: id(p) for name, p in model.named_parameters()}
    inputs = example_inputs("sd3", model)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        forward(model, inputs)
        assert {name: id(p) for name, p in model.named_parameters()} == before
        streamed = list(model.transformer_blocks.parameters())
        assert all(p.numel() == 0 for p in streamed)
        assert all(p.numel() > 0 for p in model.proj_out.parameters())
    assert all(p.numel() > 0 for p in model.parameters())


def test_hook_of_block_i_prefetches_block_i_plus_1_and_the_last_prefetches_the_first() -> None:
    model = tiny_model("wan", num_layers=3)
    inputs = example_inputs("wan", model)
    events: list[str] = []
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        source = backend._source
        assert source is not None
        load = source.load
        source.load = lambda index, slot: (events.append(f"load {index}"), load(index, slot))[1]
        for index, block in enumerate(model.blocks):
            block.register_forward_hook(lambda *_, i=index: events.append(f"ran {i}"))
        forward(model, inputs)
        forward(model, inputs)
        step = ["load 1", "ran 0", "load 2", "ran 1", "load 0", "ran 2"]
        assert events == step + step


def test_a_skipped_block_keeps_outputs_exact() -> None:
    """SD3 can skip layers; the prefetched block is then replaced by the one that runs."""
    reference = tiny_model("sd3")
    inputs = example_inputs("sd3", reference)
    expected_skip = forward(reference, inputs | {"skip_layers": [1]})
    expected = forward(reference, inputs)
    model = tiny_model("sd3")
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        assert torch.equal(forward(model, inputs | {"skip_layers": [1]}), expected_skip)
        assert torch.equal(forward(model, inputs), expected)


def test_a_block_that_raises_leaves_the_next_forward_exact() -> None:
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    model = tiny_model("wan")
    failures = [RuntimeError("injected")]

    def fail_once(*_: Any) -> None:
        if failures:
            raise failures.pop()

    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        handle = model.blocks[1].register_forward_pre_hook(fail_once)
        with pytest.raises(RuntimeError, match="injected"):
            forward(model, inputs)
        handle.remove()
        assert torch.equal(forward(model, inputs), expected)


def test_inference_mode_forward_is_exact() -> None:
    reference = tiny_model("flux")
    inputs = example_inputs("flux", reference)
    expected = forward(reference, inputs)
    model = tiny_model("flux")
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        with torch.inference_mode():
            assert torch.equal(model(**inputs)[0], expected)


def test_a_model_declaring_its_own_plan_with_heterogeneous_blocks() -> None:
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    expected = forward(seeded(DeclaredDiT), {"x": x})
    model = seeded(DeclaredDiT)
    settings = offload_settings(use_allgather=False, resident_layers=1)
    with DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu") as backend:
        assert [layout.path for layout in backend.layouts] == [
            "stem.1", "stem.2", "head.0", "head.1",
        ]
        assert set(backend.layouts[0].numels) == {torch.float32, torch.float64}
        assert backend.slot_bytes == 2 * max(layout.nbytes for layout in backend.layouts)
        assert backend.slot_bytes == 2 * backend.layouts[0].nbytes
        assert torch.equal(forward(model, {"x": x}), expected)
        assert torch.equal(forward(model, {"x": x}), expected)
        assert model.stem[1].bias_cache.numel() == 16
    assert torch.equal(forward(model, {"x": x}), expected)


def test_a_model_without_a_plan_streams_the_block_lists_holding_the_bulk() -> None:
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    expected = forward(seeded(UndeclaredDiT), {"x": x})
    model = seeded(UndeclaredDiT)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        assert [layout.path for layout in backend.layouts] == [
            "layers.0", "layers.1", "layers.2", "adapters.0", "adapters.1"]
        assert torch.equal(forward(model, {"x": x}), expected)
        assert torch.equal(forward(model, {"x": x}), expected)


def test_enable_again_after_disable_and_disable_twice() -> None:
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    model = tiny_model("wan")
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    for _ in range(2):
        backend.enable()
        with pytest.raises(OffloadError, match="^DLO is already enabled on this model$"):
            backend.enable()
        assert torch.equal(forward(model, inputs), expected)
        backend.disable()
        backend.disable()
        assert backend.slot_bytes == 0 and host_bytes(backend.host_tensors()) == 0
        assert all(not block._forward_pre_hooks for block in model.blocks)
        assert torch.equal(forward(model, inputs), expected)


def test_disable_without_restore_leaves_placeholders() -> None:
    model = tiny_model("wan")
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    backend.enable()
    backend.disable(restore=False)
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    assert all(not block._forward_hooks for block in model.blocks)


def test_disable_without_restore_after_a_block_raised_frees_the_slots() -> None:
    """A forward that raised inside block 1 left block 1's tensors in a slot; shutdown
    (`OffloadHandle.close()`) still leaves only placeholders, so the slots are freed."""
    model = tiny_model("wan")
    inputs = example_inputs("wan", model)
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    backend.enable()
    slot_flats = [weakref.ref(flat) for slot in backend.slots.slots
                  for flat in slot.flats.values()]

    def fail(*_: Any) -> None:
        raise RuntimeError("injected")

    model.blocks[1].norm2.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        forward(model, inputs)
    backend.disable(restore=False)
    gc.collect()
    assert [name for name, p in model.blocks.named_parameters() if p.numel() > 0] == []
    assert [ref() for ref in slot_flats] == [None] * len(slot_flats)


def test_invalid_settings_fail_before_the_model_changes() -> None:
    model = tiny_model("wan")
    before = [p.data_ptr() for p in model.parameters()]
    settings = offload_settings(use_allgather=True, resident_layers=1)
    with pytest.raises(SettingsError) as caught:
        DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu")
    assert str(caught.value) == (
        "invalid settings: offload.resident_layers, offload.use_allgather: "
        "offload.resident_layers=1 needs rank-local blocks [resident-layers-allgather]; "
        "fix: set offload.use_allgather=false or offload.resident_layers=0"
    )
    assert [p.data_ptr() for p in model.parameters()] == before


def test_a_document_rendered_from_a_cr_names_the_cr_path_and_the_document_path() -> None:
    settings = offload_settings(use_allgather=True, resident_layers=1).model_copy(
        update={"origin": "DiffusionOffloadDeployment default/flux"})
    with pytest.raises(SettingsError) as caught:
        DistributedLayerwiseOffloadBackend(tiny_model("wan"), settings=settings, device="cpu")
    assert str(caught.value) == (
        "invalid settings: spec.offload.residentLayers, spec.offload.useAllgather: "
        "spec.offload.residentLayers=1 needs rank-local blocks [resident-layers-allgather]; "
        "fix: set spec.offload.useAllgather=false or spec.offload.residentLayers=0 "
        "(document rendered from DiffusionOffloadDeployment default/flux; in the document "
        "spec.offload.residentLayers is offload.resident_layers, "
        "spec.offload.useAllgather is offload.use_allgather)"
    )


def test_disabled_offload_is_refused() -> None:
    settings = Settings.from_dict({"offload": {"enabled": False}})
    with pytest.raises(SettingsError) as caught:
        DistributedLayerwiseOffloadBackend(tiny_model("wan"), settings=settings, device="cpu")
    assert str(caught.value) == "offload.enabled=false: the DLO backend would have nothing to do"


def test_allgather_settings_without_a_group_are_refused() -> None:
    with pytest.raises(OffloadError) as caught:
        DistributedLayerwiseOffloadBackend(
            tiny_model("wan"), settings=offload_settings(dp=2), device="cpu"
        )
    assert str(caught.value) == (
        "the settings select the existing DP group of 2 ranks for DLO AllGather, but no group "
        "was passed and the default group is not that group"
    )
    assert caught.value.hint == (
        "pass the existing group as group=, or set offload.use_allgather=false"
    )


def test_too_many_resident_layers_are_refused_before_the_model_changes() -> None:
    model = tiny_model("wan")
    settings = offload_settings(use_allgather=False, resident_layers=3)
    backend = DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu")
    with pytest.raises(OffloadPlanError) as caught:
        backend.enable()
    assert str(caught.value) == (
        "offload.resident_layers=3 leaves no block to stream: WanTransformer3DModel has 3 "
        "blocks; use at most 2"
    )
    assert not backend.enabled and all(p.numel() > 0 for p in model.parameters())


def test_settings_rendered_from_a_cr_are_named_as_the_cr_writes_them() -> None:
    """The operator renders the settings from a DOD (`origin` names it): the runtime's own
    errors name `spec.offload.residentLayers`, the field the user wrote, not the document's."""
    from_cr = {"origin": "DiffusionOffloadDeployment default/wan"}
    settings = offload_settings(use_allgather=False, resident_layers=3).model_copy(update=from_cr)
    with pytest.raises(OffloadPlanError) as caught:
        DistributedLayerwiseOffloadBackend(tiny_model("wan"), settings=settings,
                                           device="cpu").enable()
    assert str(caught.value).startswith("spec.offload.residentLayers=3 leaves no block to stream")
    with pytest.raises(OffloadError) as caught:
        DistributedLayerwiseOffloadBackend(
            tiny_model("wan"), settings=offload_settings(dp=2).model_copy(update=from_cr),
            device="cpu")
    assert caught.value.hint.endswith("or set spec.offload.useAllgather=false")
    from dlo_runtime.checkpoint_plan import settings_reason
    tp2 = Settings.from_dict({"parallel": {"tp": 2}}).model_copy(update=from_cr)
    reason = settings_reason(tp2, names_for(tp2))
    assert reason is not None and "(spec.parallel.tp=2)" in reason


def test_resident_blocks_only_from_the_lists_the_plan_allows() -> None:
    settings = offload_settings(use_allgather=False, resident_layers=4)
    backend = DistributedLayerwiseOffloadBackend(
        seeded(DeclaredDiT), settings=settings, device="cpu"
    )
    with pytest.raises(OffloadPlanError) as caught:
        backend.enable()
    assert str(caught.value) == (
        "offload.resident_layers=4 would keep head.0 resident, but the offload plan allows "
        "resident blocks only from stem; lower offload.resident_layers"
    )
