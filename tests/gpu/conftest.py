"""Every test under tests/gpu needs a CUDA device; without one each is skipped with the reason."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False here")
