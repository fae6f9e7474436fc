"""On CUDA: host arenas are page-locked at their exact size (pinned host bytes within a page per
arena of the plan's bytes) and report pinned, and the statistics count every load of a forward
and time compute's waits with events."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlo_bench.models import example_inputs, tiny_model
from dlo_contract.settings import OffloadConfig, Settings
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.host_registration import PAGE
from dlo_runtime.pinned_arena import PinnedHostMemory

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_exact_pinned_arenas_and_stats_on_cuda() -> None:
    reference = tiny_model("flux", num_layers=6, dtype=torch.bfloat16)
    inputs = {k: v.to(CUDA) if torch.is_tensor(v) else v
              for k, v in example_inputs("flux", reference).items()}
    with torch.no_grad():
        expected = nn.Module.to(reference, CUDA)(**inputs)[0]
    model = tiny_model("flux", num_layers=6, dtype=torch.bfloat16)
    settings = Settings(offload=OffloadConfig(use_allgather=False))
    with DistributedLayerwiseOffloadBackend(model, settings=settings, device=CUDA) as backend:
        memory = backend._streams.host_memory
        assert isinstance(memory, PinnedHostMemory)
        arenas = backend._source.host_tensors()
        assert all(t.is_pinned() for t in arenas)
        assert 0 <= memory.pinned_bytes - host_bytes(arenas) < PAGE * len(arenas)
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(**inputs)[0], expected)
        stats = backend.stats()
        assert stats.last_forward.blocks_loaded == len(backend.layouts)
        assert stats.last_forward.bytes_h2d == sum(layout.nbytes for layout in backend.layouts)
        assert stats.total.forwards == 3
        assert stats.total.slot_wait_s >= 0.0
