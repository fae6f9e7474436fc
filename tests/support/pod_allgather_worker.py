"""Body of each rank of the two-process gloo "server" started by `test_pod_allgather.py`: it
serves a weightless DiT from a checkpoint plan in AllGather mode through `dlo_runtime.pod`.

The settings document and the entry file are `settings.json` and `entry.json` in the world's
directory; each rank points DLO_CONFIG and DLO_ENTRY_FILE at them, as the pod's environment
would. Its outcome: the backing, whether the offloaded output equals the resident model's,
whether the mapping was released after enable, and what a call of the DiT raises once the
handle is closed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from support.gloo_world import in_gloo_rank

from dlo_bench.models import example_inputs, tiny_model
from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV
from dlo_runtime import pod

SETTINGS = "settings.json"
ENTRY = "entry.json"


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ[CONFIG_ENV] = str(Path(out_dir, SETTINGS))
    os.environ[ENTRY_FILE_ENV] = str(Path(out_dir, ENTRY))
    in_gloo_rank(rank, world, port, out_dir, _outcome)


def _outcome(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    resident = tiny_model("flux")
    inputs = example_inputs("flux", resident)
    dit = pod.build_dit(FluxTransformer2DModel)
    weightless = all(p.is_meta for p in dit.parameters())
    handle = pod.enable(dit, device="cpu")
    with open("/proc/self/maps") as maps:
        mapped = "/v1/entries/" in maps.read()
    with torch.no_grad():
        equal = torch.equal(dit(**inputs)[0], resident(**inputs)[0])
    backing = handle.backing().value
    handle.close()
    return {"rank": dist.get_rank(), "weightless": weightless, "backing": backing,
            "equal": equal, "mapped_after_enable": mapped, "after_close": _call(dit, inputs)}


def _call(dit: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> str:
    """The message of the error a call of `dit` raises (its class first)."""
    try:
        with torch.no_grad():
            dit(**inputs)
    except Exception as exc:  # noqa: BLE001 - reported whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "no error"
