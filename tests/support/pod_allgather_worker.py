"""One rank of a two-process gloo "server" that serves a weightless DiT from a checkpoint plan in
AllGather mode through `dlo_runtime.pod`.

Usage: pod_allgather_worker.py RANK WORLD PORT. The settings document and the entry file come
from DLO_CONFIG and DLO_ENTRY_FILE. Prints one JSON line: the backing, whether the offloaded
output equals the resident model's, whether the mapping was released after enable, and what a
call of the DiT raises once the handle is closed.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime import pod


def main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
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
        after_close = _call(dit, inputs)
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "weightless": weightless, "backing": backing,
                      "equal": equal, "mapped_after_enable": mapped, "after_close": after_close}))


def _call(dit: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> str:
    """The message of the error a call of `dit` raises (its class first)."""
    try:
        with torch.no_grad():
            dit(**inputs)
    except Exception as exc:  # noqa: BLE001 - reported whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "no error"


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
