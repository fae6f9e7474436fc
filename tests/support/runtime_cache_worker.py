"""One serving process with the runtime cache on: ordinary load, then publish or join.

Usage: runtime_cache_worker.py CACHE_ROOT. Loads twice: once at start, and again after a line on
stdin (the test may damage the entry in between). After each load it prints one JSON line: the
entry id, whether this process published, the fallback reason, whether the plan's tensors equal
the ordinary ones, and whether the entry's files are mapped into this process.

The DiT is the hand-written one of `support.runtime_models` (two block classes, a float64
buffer): the cache sees only tensors, and a process that imports no diffusers starts seconds
sooner.
"""

from __future__ import annotations

import json
import sys

import torch
from support.runtime_models import DeclaredDiT, seeded

from dlo_runtime.runtime_weight_cache import RuntimeLayout, load_runtime_plan
from dlo_contract.settings import Settings, replace_path


def main(root: str) -> None:
    settings = Settings()
    for dotted, value in (("offload.use_allgather", False), ("offload.enable_runtime_cache", True),
                          ("cache.root", root)):
        settings = replace_path(settings, dotted, value)
    model = seeded(DeclaredDiT)
    report(model, settings)
    sys.stdin.readline()
    report(model, settings)


def report(model: torch.nn.Module, settings: Settings) -> None:
    result = load_runtime_plan(model, settings, RuntimeLayout())
    found = {"entry_id": result.entry_id, "published": result.published,
             "reason": result.reason, "equal": None, "mapped": False}
    if result.plan is not None:
        tensors = result.plan.take_tensors()
        state = model.state_dict()
        found["equal"] = tensors.keys() == state.keys() and all(
            torch.equal(tensors[k], state[k]) for k in state)
        with open("/proc/self/maps") as maps:
            found["mapped"] = f"/entries/{result.entry_id}/" in maps.read()
        result.plan.close()
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
