"""Fixtures for the host-storage tests: a tiny Flux DiT and its checkpoint in diffusers layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from dlo_bench.models import save_diffusers_layout, tiny_model


@pytest.fixture(scope="session")
def flux() -> nn.Module:
    return tiny_model("flux")


@pytest.fixture(scope="session")
def flux_layout(tmp_path_factory: pytest.TempPathFactory, flux: nn.Module) -> Path:
    """`<dir>/transformer/` with config.json and the weights sharded in three files."""
    directory = tmp_path_factory.mktemp("flux-layout")
    save_diffusers_layout(flux, directory, max_shard_bytes=200_000)
    return directory
