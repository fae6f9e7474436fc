"""Serve a DiT with DLO the way an inference server in a dlo pod does.

In a pod, the loader sidecar fills the node cache and writes `/run/dlo/entry.json` while the
server starts (`pod.build_dit` waits for it, `DLO_ENTRY_WAIT_SECONDS`), and the operator
mounted the settings document at `$DLO_CONFIG`. This example plays those parts first (a tiny
random Flux published into a scratch cache), then runs the server side, which is the part to
copy:

    dit = pod.build_dit(FluxTransformer2DModel)   # no weights loaded: the entry backs them
    handle = pod.enable(dit)                      # or pod.enable(pipeline)
    output = dit(**inputs)                        # blocks stream through two device slots
    handle.close()                                # before destroying any process group

Run: python examples/serve_example.py
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel

from dlo_bench.entries import publish_layout, rank_local_settings
from dlo_bench.models import example_inputs, save_diffusers_layout, tiny_model
from dlo_contract import names
from dlo_runtime import pod


def play_loader_and_operator(scratch: Path, model: torch.nn.Module) -> None:
    """What `dlo cache fill` and the operator would have done before the server starts."""
    save_diffusers_layout(model, scratch / "checkpoint")
    entry = publish_layout(scratch / "cache", scratch / "checkpoint", "s3://models/flux-tiny/")
    (scratch / "entry.json").write_text(entry.to_json())
    (scratch / "settings.json").write_text(rank_local_settings(scratch / "cache").to_json())
    os.environ[names.CONFIG_ENV] = str(scratch / "settings.json")
    os.environ[names.ENTRY_FILE_ENV] = str(scratch / "entry.json")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    resident = tiny_model("flux")
    inputs = example_inputs("flux", resident)
    with tempfile.TemporaryDirectory() as scratch:
        play_loader_and_operator(Path(scratch), resident)

        dit = pod.build_dit(FluxTransformer2DModel)
        handle = pod.enable(dit)
        backing = handle.backing()
        try:
            on_device = {k: v.to(handle.device) if isinstance(v, torch.Tensor) else v
                         for k, v in inputs.items()}
            with torch.no_grad():
                output = dit(**on_device)[0].cpu()
        finally:
            handle.close()

    with torch.no_grad():  # on the same device: kernels of two devices differ in the last bit
        expected = resident.to(handle.device)(**on_device)[0].cpu()
    same = torch.equal(output, expected)
    print(f"host backing: {backing.value}; output {'equal to' if same else 'DIFFERS from'} the "
          f"resident model's bit for bit (largest difference "
          f"{(output - expected).abs().max().item():g})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
