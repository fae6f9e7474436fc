"""The checks `dlo serve` makes at start on the entry's pipeline, without a server: a pipeline or
component class it cannot serve, and a component the entry lacks, are refused naming the class or
folder and the fix; the served families' sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dlo_bench.serve_model import Family, save_pipeline

from dlo_runtime.errors import PodError
from dlo_server import pipeline as pipelines
from dlo_server.sampler import Sampler


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline(Family.FLUX, tmp_path_factory.mktemp("flux") / "model")


def copy_of(folder: Path, tmp_path: Path, **index_changes: object) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, **index_changes}))
    return copy


def test_the_flux_entry_passes_and_names_its_dit_class(flux_folder: Path) -> None:
    index = pipelines.index_of(flux_folder)
    assert pipelines.family_of(index).pipeline == "FluxPipeline"
    assert pipelines.check_components(flux_folder, index).__name__ == "FluxTransformer2DModel"
    assert set(pipelines.components_of(index)) == {
        "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
        "transformer", "vae"}  # the optional image encoder (null in the index) is left out


def test_a_pipeline_it_does_not_serve_is_refused_naming_the_class_and_those_served(
        flux_folder: Path, tmp_path: Path) -> None:
    copy = copy_of(flux_folder, tmp_path, _class_name="StableDiffusionXLPipeline")
    with pytest.raises(PodError) as caught:
        pipelines.family_of(pipelines.index_of(copy))
    assert str(caught.value).startswith(
        "model_index.json names the pipeline StableDiffusionXLPipeline, which dlo serve does not "
        "serve; it serves FluxPipeline, StableDiffusion3Pipeline, ZImagePipeline, WanPipeline")


def test_a_component_class_it_cannot_load_is_refused_naming_it(flux_folder: Path,
                                                               tmp_path: Path) -> None:
    copy = copy_of(flux_folder, tmp_path, text_encoder=["my_package", "MyEncoder"])
    with pytest.raises(PodError) as caught:
        pipelines.check_components(copy, pipelines.index_of(copy))
    assert str(caught.value).startswith(
        "model_index.json: component text_encoder is my_package.MyEncoder, which dlo serve "
        "cannot load; components come from diffusers or transformers")


def test_an_entry_without_a_listed_component_names_it_and_the_include(flux_folder: Path,
                                                                       tmp_path: Path) -> None:
    copy = copy_of(flux_folder, tmp_path)
    shutil.rmtree(copy / "tokenizer_2")
    shutil.rmtree(copy / "text_encoder_2")
    with pytest.raises(PodError) as caught:
        pipelines.check_components(copy, pipelines.index_of(copy))
    assert str(caught.value).startswith(
        "the entry lacks text_encoder_2/, tokenizer_2/, which model_index.json lists")
    assert caught.value.hint.endswith('(or add "text_encoder_2/*", "tokenizer_2/*")')


def test_an_entry_without_the_index_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PodError, match=r"^the entry has no model_index.json"):
        pipelines.index_of(tmp_path)


@pytest.mark.parametrize(("family", "multiple"), [
    (Family.FLUX, 4), (Family.SD3, 4), (Family.ZIMAGE, 4), (Family.WAN, 16)])
def test_sizes_are_multiples_of_the_vae_factor_times_the_patch(tmp_path: Path, family: Family,
                                                               multiple: int) -> None:
    folder = save_pipeline(family, tmp_path / "model")
    index = pipelines.index_of(folder)
    dit_cls = pipelines.check_components(folder, index)
    dit = dit_cls.from_config(dit_cls.load_config(folder / "transformer"))
    sampler = Sampler(pipelines.load_pipeline(folder, index, dit), pipelines.family_of(index))
    assert sampler.size_multiple == multiple
    assert sampler.frame_multiple == (4 if family is Family.WAN else 1)

