"""The cold-start benchmark's server processes: one per way of getting the DiT to a first forward.

`python -m dlo_bench.coldstart_paths PATH --out DIR` runs one configuration in a fresh process
and writes `DIR/PATH.pt` (the first forward's output) and `DIR/PATH.json` (wall-clock marks, in
seconds since the epoch, so the parent can subtract its own spawn time):
- `dlo`: the main container of a pod whose loader sidecar fills meanwhile: `prefetch.start()`
  first (or, with `--prefetch build`, no call: `pod.build_dit` starts it), then the imports,
  `pod.build_dit` (weightless), `pod.enable` (rank-local, CPU), the forward;
- `plain`: boto3 `download_file` of every object, then `from_pretrained` (accelerate installed
  where the benchmark's venv has it) and the forward;
- `runai`: runai-model-streamer streaming the shards from S3 into a meta-initialized model
  (`load_state_dict(assign=True)`), then the forward.
This module imports only the standard library at the top, so no path pays for another's imports.
Called by `dlo_bench.coldstart`; must not be imported by the planes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PATHS = ("dlo", "plain", "runai")


def _dlo(args: argparse.Namespace, marks: dict[str, float]) -> Any:
    from dlo_runtime import prefetch

    if args.prefetch == "early":
        prefetch.start()
    import torch
    from dlo_runtime import pod

    from dlo_bench import coldstart_model, page_cache

    cls = coldstart_model.model_class()
    torch.set_num_threads(args.torch_threads)
    marks["imported"] = time.time()
    dit = pod.build_dit(cls, dtype=torch.bfloat16)
    marks["built"] = time.time()
    marks["weightless"] = float(all(p.is_meta for p in dit.parameters()))
    handle = pod.enable(dit, device="cpu")
    marks["enabled"] = time.time()
    entry = pod.read_entry_file()
    assert entry is not None
    marks["resident_bytes_at_forward"] = page_cache.resident_bytes([entry.path])
    warming = prefetch.start()  # the warmer started above, or by build_dit
    marks["prefetch_done"] = warming.finished_at() if warming else None
    out = _first_forward(dit, marks)
    handle.close()
    return out


def _plain(args: argparse.Namespace, marks: dict[str, float]) -> Any:
    import boto3
    import torch
    from botocore.config import Config

    from dlo_bench import coldstart_model

    cls = coldstart_model.model_class()
    torch.set_num_threads(args.torch_threads)
    marks["imported"] = time.time()
    client = boto3.client("s3", endpoint_url=args.endpoint_url,
                          config=Config(s3={"addressing_style": "path"}))
    bucket, _, prefix = args.source.removeprefix("s3://").partition("/")
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    for item in listing["Contents"]:
        target = Path(args.download) / item["Key"][len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, item["Key"], str(target))
    marks["downloaded"] = time.time()
    model = cls.from_pretrained(Path(args.download) / "transformer", torch_dtype=torch.bfloat16)
    marks["loaded"] = time.time()
    return _first_forward(model, marks)


def _runai(args: argparse.Namespace, marks: dict[str, float]) -> Any:
    import torch
    from runai_model_streamer import SafetensorsStreamer, list_safetensors, pull_files

    from dlo_bench import coldstart_model

    cls = coldstart_model.model_class()
    torch.set_num_threads(args.torch_threads)
    marks["imported"] = time.time()
    folder = args.source + "transformer/"
    pull_files(folder, args.download, allow_pattern=["*.json"])
    config = cls.load_config(args.download)
    with torch.device("meta"):
        model = cls.from_config(config)
    state: dict[str, Any] = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(list_safetensors(folder))
        for name, tensor in streamer.get_tensors():
            state[name] = tensor
    marks["streamed"] = time.time()
    model.load_state_dict(state, assign=True, strict=True)
    model.eval()
    marks["loaded"] = time.time()
    return _first_forward(model, marks)


def _first_forward(model: Any, marks: dict[str, Any]) -> Any:
    """The measured end of every path: one forward on the benchmark's inputs, timed."""
    import torch

    from dlo_bench import coldstart_model

    marks["forward_start"] = time.time()
    with torch.no_grad():
        out = model(**coldstart_model.inputs(model.config))[0]
    marks["forward"] = time.time()
    return out


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(prog="python -m dlo_bench.coldstart_paths")
    parser.add_argument("path", choices=PATHS)
    parser.add_argument("--out", type=Path, required=True, help="where the output and marks go")
    parser.add_argument("--name", help="file name stem of the results (default: the path)")
    parser.add_argument("--source", help="s3://bucket/prefix/ of the checkpoint")
    parser.add_argument("--endpoint-url")
    parser.add_argument("--download", help="local directory for downloaded files")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--prefetch", choices=("early", "build"), default="early",
                        help="dlo: warm the entry before the imports, or from build_dit on")
    args = parser.parse_args(argv)
    marks: dict[str, Any] = {"main": started}
    out = {"dlo": _dlo, "plain": _plain, "runai": _runai}[args.path](args, marks)
    import torch

    stem = args.name or args.path
    torch.save(out.detach().clone(), args.out / f"{stem}.pt")
    (args.out / f"{stem}.json").write_text(json.dumps(marks) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the forward is the end of the measurement; skip interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
