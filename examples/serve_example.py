"""Serve a DiT with DLO the way an inference server in a dlo pod does.

In a pod, the loader sidecar fills the node cache and writes `/run/dlo/entry.json` while the
server starts (`pod.build_dit` waits for it, `DLO_ENTRY_WAIT_SECONDS`), and the operator mounted the settings document at `$DLO_CONFIG`. This
example plays those parts first (a tiny random Flux published into a scratch cache), then runs the
server side, which is the part to copy:

    dit = pod.build_dit(FluxTransformer2DModel)   # no weights loaded: the entry backs them
    handle = pod.enable(dit)                      # or pod.enable(pipeline)
    output = dit(**inputs)                        # blocks stream through two device slots
    handle.close()                                # before destroying any process group

Run: python examples/serve_example.py
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel

from dlo_bench.models import example_inputs, save_diffusers_layout, tiny_model
from dlo_runtime import pod
from dlo_contract.cache import (
    FileRecord, ObjectIdentity, checkpoint_identity, entry_id, publish_entry, sha256_file,
)
from dlo_contract.settings import Settings, replace_path


def play_loader_and_operator(scratch: Path, model: torch.nn.Module) -> None:
    """What `dlo cache fill` and the operator would have done before the server starts."""
    layout = scratch / "checkpoint"
    save_diffusers_layout(model, layout)
    files = sorted(p for p in layout.rglob("*") if p.is_file())
    names = [str(p.relative_to(layout)) for p in files]
    identity = checkpoint_identity("s3://models/flux-tiny/", [
        ObjectIdentity(n, p.stat().st_size, sha256_file(p)) for n, p in zip(names, files)])

    def write(tmp: Path) -> list[FileRecord]:
        for name, path in zip(names, files):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / name)
        return [FileRecord(n, p.stat().st_size) for n, p in zip(names, files)]

    root = scratch / "cache"
    eid = entry_id(identity)
    path = publish_entry(root, eid, "checkpoint", identity, write, expected_bytes=1 << 20,
                         lock_timeout_s=10)
    (scratch / "entry.json").write_text(json.dumps(
        {"entry_id": eid, "kind": "checkpoint", "root": str(root), "path": str(path)}))
    settings = replace_path(Settings(), "offload.use_allgather", False)
    (scratch / "settings.json").write_text(replace_path(settings, "cache.root",
                                                        str(root)).to_json())
    os.environ["DLO_CONFIG"] = str(scratch / "settings.json")
    os.environ["DLO_ENTRY_FILE"] = str(scratch / "entry.json")


def main() -> None:
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

    with torch.no_grad():
        expected = resident(**inputs)[0]
    print(f"host backing: {backing.value}; largest difference from the resident model: "
          f"{(output - expected).abs().max().item():g}")


if __name__ == "__main__":
    main()
