"""HostWeightPlan: one consumer, declared transforms bounded, sources released in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dlo_runtime.host_weight_plan import (
    MAX_TRANSFORMS, BackingKind, DeclaredTransform, HostPlanError, HostWeightPlan, TensorBinding,
)
from dlo_runtime.layout import ALIGN_BYTES
from dlo_runtime.mapping import (
    PADDING_KEY, MappedEntry, MappingError, read_header, write_safetensors,
)


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def unregister(self) -> None:
        self.events.append("unregister")

    def close(self) -> None:
        self.events.append("close-mapping")


@pytest.fixture
def stored(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = {"a.weight": torch.randn(4, 6), "a.bias": torch.randn(6).bfloat16(),
               "steps": torch.arange(5), "empty": torch.zeros(0, 3)}
    write_safetensors(tmp_path / "w.safetensors", tensors)
    return tensors


def mapped_plan(directory: Path, recorder: Recorder | None = None,
                transforms: tuple[DeclaredTransform, ...] = (),
                skips: bool = False) -> HostWeightPlan:
    header = read_header(directory / "w.safetensors")
    bindings = [TensorBinding(name=k, file="w.safetensors", offset=s.offset, dtype=s.dtype,
                              shape=s.shape) for k, s in header.items()]
    return HostWeightPlan(backing_kind=BackingKind.CHECKPOINT, bindings=bindings,
                          transforms=transforms, skips_ordinary_load=skips,
                          source=MappedEntry(directory, handle=recorder))


def test_written_file_is_standard_safetensors(tmp_path: Path, stored) -> None:
    """The reference reader loads the stored tensors, and the padding tensors the metadata
    names, which `read_header` leaves out."""
    loaded = load_file(tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as opened:
        padding = opened.metadata()[PADDING_KEY].split(",")
    assert all(torch.equal(loaded[k], stored[k]) for k in stored)
    assert loaded.keys() == stored.keys() | set(padding) and padding
    assert read_header(tmp_path / "w.safetensors").keys() == stored.keys()


def test_every_written_tensor_starts_on_the_compute_alignment(tmp_path: Path, stored) -> None:
    """A mapping of the file hands compute what a fresh allocation has, so no load copies."""
    offsets = {key: s.offset for key, s in read_header(tmp_path / "w.safetensors").items()}
    assert offsets and all(offset % ALIGN_BYTES == 0 for offset in offsets.values())
    views = mapped_plan(tmp_path).take_tensors()
    assert all(v.data_ptr() % ALIGN_BYTES == 0 for v in views.values() if v.numel())


def test_take_tensors_exactly_once(tmp_path: Path, stored) -> None:
    plan = mapped_plan(tmp_path)
    tensors = plan.take_tensors()
    assert all(torch.equal(tensors[k], stored[k]) for k in stored)
    with pytest.raises(HostPlanError) as caught:
        plan.take_tensors()
    assert str(caught.value) == ("take_tensors() was already called on this checkpoint plan; a "
                                 "plan has exactly one consumer")
    plan.close()


def test_ordinary_plan_hands_over_its_tensors() -> None:
    tensor = torch.ones(3)
    plan = HostWeightPlan.ordinary({"w": tensor})
    assert plan.backing_kind is BackingKind.ORDINARY and not plan.sources_pinned
    assert plan.take_tensors()["w"] is tensor


def test_unconsumed_plan_that_skipped_the_load_is_an_error(tmp_path: Path, stored) -> None:
    plan = mapped_plan(tmp_path, skips=True)
    with pytest.raises(HostPlanError) as caught:
        plan.require_consumed()
    assert str(caught.value) == (
        "the DiT was built without weights for a checkpoint plan that no offload backend "
        "consumed; its parameters are placeholders")
    plan.take_tensors()
    plan.require_consumed()
    plan.close()


def test_close_unregisters_before_the_mapping_closes(tmp_path: Path, stored) -> None:
    recorder = Recorder()
    plan = mapped_plan(tmp_path, recorder)
    plan.attach_registration(recorder)
    assert plan.sources_pinned
    plan.take_tensors()
    plan.release_sources()
    plan.close()
    assert recorder.events == ["unregister", "close-mapping"]


def test_declared_transform_is_a_view(tmp_path: Path, stored) -> None:
    plan = mapped_plan(tmp_path, transforms=(DeclaredTransform(name="a.weight", shape=(24,)),))
    view = plan.take_tensors()["a.weight"]
    assert view.shape == (24,) and torch.equal(view, stored["a.weight"].reshape(-1))
    plan.close()


def test_transforms_are_bounded(tmp_path: Path, stored) -> None:
    with pytest.raises(HostPlanError) as caught:
        mapped_plan(tmp_path, transforms=(DeclaredTransform(name="a.weight", shape=(5, 5)),))
    assert str(caught.value) == ("transform of 'a.weight' to shape [5, 5] does not keep the 24 "
                                 "elements of stored shape [4, 6]")
    many = tuple(DeclaredTransform(name="a.weight", shape=(24,))
                 for _ in range(MAX_TRANSFORMS + 1))
    with pytest.raises(HostPlanError) as caught:
        mapped_plan(tmp_path, transforms=many)
    assert str(caught.value) == (f"{MAX_TRANSFORMS + 1} declared transforms exceed the bound of "
                                 f"{MAX_TRANSFORMS}; load this model ordinarily")


def test_views_outlive_a_closed_mapping_safely(tmp_path: Path, stored) -> None:
    plan = mapped_plan(tmp_path)
    tensors = plan.take_tensors()
    plan.close()
    assert torch.equal(tensors["a.weight"], stored["a.weight"])


def test_damaged_header_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(MappingError) as caught:
        read_header(bad)
    assert str(caught.value) == (
        f"{bad}: invalid safetensors header: header length field is {2**64 - 1}; "
        "expected 2 to 100000000")
