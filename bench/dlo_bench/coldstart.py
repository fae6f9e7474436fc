"""`dlo bench coldstart`: S3 to the first forward of a ~1 GB DiT on one node, against its peers.

Owns the cold-start benchmark. ministack serves the checkpoint of `coldstart_model`; each
configuration runs in fresh processes after the benchmark's files are made cold
(`page_cache.evict`, or `--cold system` for the whole machine's page cache), in interleaved
rounds, and is timed from spawning its first process to the end of the first forward:
- `dlo`: `dlo cache fill --yield-cpu` (a fresh cache root: the pod's loader sidecar, which
  exits here instead of staying up) and, started with it, the server process of
  `coldstart_paths dlo` (the main container), which waits for the entry document
  (`DLO_ENTRY_WAIT_SECONDS`) as in a pod: the server's imports overlap the fill;
- `plain`: boto3 download and `from_pretrained` in one process;
- `runai`: runai-model-streamer into a meta-initialized model in one process;
- `dlo_late`: as `dlo`, but the server does not call `prefetch.start()` before its imports, so
  the entry is warmed from `pod.build_dit` on (a server that does nothing for dlo's sake);
- `dlo_warm`: the entry already on disk (a second pod on the node), cold: fill (finds it) and
  server, started together.
Every first-forward output must equal the plain path's (`torch.equal`). The report gives each
configuration's median total and phases, the loader's start-to-transfer time and peak memory,
and the ratios dlo/plain, dlo/runai and dlo_warm/plain against the goals. `--json` prints one JSON
object as the last line. Must not be imported by the planes.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV, ENTRY_WAIT_ENV
from dlo_contract.settings import CacheConfig, OffloadConfig, Settings
from dlo_contract.validation import validate

from dlo_bench import coldstart_model, page_cache, provenance
from dlo_bench.s3server import DUMMY_CREDENTIALS, start_ministack, upload_tree

BUCKET = "models"
PREFIX = "flux-coldstart"
CONFIGS = ("dlo", "plain", "runai", "dlo_late", "dlo_warm")
_SERVER = {"dlo": ("dlo", "early"), "plain": ("plain", None), "runai": ("runai", None),
           "dlo_late": ("dlo", "build"), "dlo_warm": ("dlo", "early")}
"""Each configuration's server process: its path in `coldstart_paths`, and when dlo prefetches."""
GOALS = {"dlo/plain": 0.9, "dlo/runai": 1.0, "dlo_warm/plain": 0.75}
_TRANSFER_MARK = " plan: "
"""The loader's log line written just before its first GET (the start of the transfer)."""
_CHILD_TIMEOUT_S = 600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--json", action="store_true", help="print one JSON object as the last line")
    add("--ministack", default=".venv-ministack/bin/ministack",
        help="ministack executable (default: %(default)s)")
    add("--rounds", type=int, default=3, help="interleaved measured rounds (default: %(default)s)")
    add("--cold", choices=("files", "system"), default="files",
        help="files: evict the benchmark's own files (fsync + POSIX_FADV_DONTNEED); system: "
             "sync and drop the whole page cache (root, quiet machine) (default: %(default)s)")
    add("--model-cache", default=".cache/coldstart",
        help="where the built checkpoint is kept between runs (default: %(default)s)")
    add("--work-dir", help="where cache roots and downloads go (default: a temp dir)")
    add("--torch-threads", type=int, default=1, help="torch threads per process (default: 1)")
    add("--runai-concurrency", type=int, default=2, help="default: %(default)s")
    add("--runai-chunk-mib", type=int, default=32, help="default: %(default)s")
    add("--output", help="also write the JSON report to this file")
    add("--small", action="store_true",
        help="a Flux of three blocks of width 64 instead of the ~1 GB one: every path runs in "
             "seconds (a test's run; its figures mean nothing)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    # A SIGTERM (a timeout, a stopped CI job) still stops ministack and removes the work dir.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.cold == "system" and not page_cache.drop_caches_writable():
        print(f"dlo bench coldstart: {page_cache.DROP_CACHES} is not writable; use --cold files",
              file=sys.stderr)
        return 2
    checkpoint = coldstart_model.ensure_checkpoint(Path(args.model_cache).resolve(),
                                                   args.small)
    _compile_bytecode()
    work = Path(tempfile.mkdtemp(prefix="dlo-bench-coldstart-", dir=args.work_dir))
    try:
        with start_ministack(args.ministack) as server:
            upload_tree(server, BUCKET, PREFIX, checkpoint)
            bench = _Bench(args, server.endpoint_url, work, checkpoint)
            report = bench.measure()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["benchmark_wall_s"] = round(time.monotonic() - started, 1)
    _print(report, args.json)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["outputs_equal"] else 1


PROJECT_PACKAGES = ("dlo_contract", "dlo_loader", "dlo_runtime", "dlo_cli", "dlo_bench")
"""Imported by the measured processes (the last two only as harness, by every path alike)."""


def _compile_bytecode() -> None:
    """Compile the project's modules as an image build does (`pip install` writes bytecode for
    every installed package, and the peers' packages have theirs): an editable checkout under
    PYTHONDONTWRITEBYTECODE would otherwise compile dlo's modules in every measured process."""
    for name in PROJECT_PACKAGES:
        spec = importlib.util.find_spec(name)
        for directory in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(directory, quiet=1)


class _Bench:
    def __init__(self, args: argparse.Namespace, endpoint_url: str, work: Path,
                 checkpoint: Path) -> None:
        self.args, self.endpoint_url, self.work, self.checkpoint = args, endpoint_url, work, checkpoint
        self.source = f"s3://{BUCKET}/{PREFIX}/"
        self.out = work / "out"
        self.out.mkdir()
        self.config = work / "settings.json"
        self.config.write_text(validate(Settings(
            offload=OffloadConfig(enabled=True, use_allgather=False),
            cache=CacheConfig(root=str(work / "cache")))).to_json())
        self.env = {**os.environ, **DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint_url,
                    "AWS_EC2_METADATA_DISABLED": "true", CONFIG_ENV: str(self.config),
                    ENTRY_FILE_ENV: str(work / "entry.json"),
                    ENTRY_WAIT_ENV: str(_CHILD_TIMEOUT_S),
                    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                    "RUNAI_STREAMER_CONCURRENCY": str(args.runai_concurrency),
                    "RUNAI_STREAMER_CHUNK_BYTESIZE": str(args.runai_chunk_mib << 20),
                    "RUNAI_STREAMER_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}

    def measure(self) -> dict[str, Any]:
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
        reference = None
        equal = True
        for round_ in range(self.args.rounds + 1):  # round 0 warms the libraries, not reported
            for config in CONFIGS:
                run = self._one(config, round_)
                out = self._output(config)
                if reference is None:
                    reference = out
                run["output_equal"] = bool(_equal(reference, out))
                equal &= run["output_equal"]
                if round_:
                    runs[config].append(run)
                print(f"round {round_} {config}: {run['total_s']:.2f} s"
                      f"{'' if run['output_equal'] else ' OUTPUT DIFFERS'}",
                      file=sys.stderr, flush=True)
        return self._report(runs, equal)

    def _cold(self) -> None:
        if self.args.cold == "system":
            page_cache.drop_system_caches()
        else:
            page_cache.evict([self.work, self.checkpoint])

    def _one(self, config: str, round_: int) -> dict[str, Any]:
        if config in ("dlo", "dlo_late"):  # a fresh node; dlo_warm then finds the entry
            shutil.rmtree(self.work / "cache", ignore_errors=True)
        shutil.rmtree(self.work / "download", ignore_errors=True)
        self._cold()
        spawn = time.time()
        run: dict[str, Any] = {"round": round_}
        server_spawn = spawn
        fill: _Fill | None = None
        if config.startswith("dlo"):
            (self.work / "entry.json").unlink(missing_ok=True)  # a new pod's run directory
            fill = _Fill(self)
            server_spawn = time.time()
        try:
            marks = self._server(config)
        finally:
            if fill is not None:
                run["fill"] = fill.result()
        run["server"] = _phases(server_spawn, marks)
        run["total_s"] = round(marks["forward"] - spawn, 3)
        return run

    def _server(self, config: str) -> dict[str, Any]:
        path, prefetch = _SERVER[config]
        argv = [sys.executable, "-m", "dlo_bench.coldstart_paths", path, "--out", str(self.out),
                "--name", config, *(["--prefetch", prefetch] if prefetch else []),
                "--source", self.source, "--endpoint-url", self.endpoint_url,
                "--download", str(self.work / "download"),
                "--torch-threads", str(self.args.torch_threads)]
        log = self.work / f"{config}.err"
        with log.open("w") as err:
            proc = subprocess.run(argv, env=self.env, stdout=err, stderr=subprocess.STDOUT,
                                  timeout=_CHILD_TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError(f"{config} failed ({proc.returncode}): {log.read_text()[-3000:]}")
        return json.loads((self.out / f"{config}.json").read_text())

    def _output(self, config: str) -> Any:
        import torch

        return torch.load(self.out / f"{config}.pt")

    def _report(self, runs: dict[str, list[dict[str, Any]]], equal: bool) -> dict[str, Any]:
        median = {c: statistics.median(r["total_s"] for r in runs[c]) for c in CONFIGS}
        name, config = coldstart_model.chosen(self.args.small)
        ratios = {"dlo/plain": median["dlo"] / median["plain"],
                  "dlo/runai": median["dlo"] / median["runai"],
                  "dlo_warm/plain": median["dlo_warm"] / median["plain"],
                  "dlo_late/plain": median["dlo_late"] / median["plain"]}
        return {
            "benchmark": "coldstart", "commit": provenance.commit(),
            "machine": provenance.machine(),
            "model": {"name": name, "bytes": _bytes(self.checkpoint), "config": config},
            "cold_cache": self.args.cold, "rounds": self.args.rounds,
            "drop_caches_writable": page_cache.drop_caches_writable(),
            "torch_threads": self.args.torch_threads,
            "runai": {"concurrency": self.args.runai_concurrency,
                      "chunk_mib": self.args.runai_chunk_mib},
            "median_total_s": {c: round(v, 3) for c, v in median.items()},
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "goals": {k: {"at_most": g, "met": ratios[k] <= g} for k, g in GOALS.items()},
            "first_forward_s": {c: statistics.median(r["server"]["forward_s"] for r in runs[c])
                                for c in CONFIGS},
            "loader": _loader_figures(runs),
            "outputs_equal": equal, "runs": runs,
        }


class _Fill:
    """`dlo cache fill` in a process of its own, reaped on a thread (its exit time and its own
    peak RSS, not the server's) while the server runs."""

    def __init__(self, bench: _Bench) -> None:
        argv = [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config",
                str(bench.config), "--source", bench.source, "--endpoint-url",
                bench.endpoint_url, "--path-style", "--entry-file", str(bench.work / "entry.json"),
                "--summary-file", str(bench.work / "summary.json"), "--yield-cpu"]
        self._logs = bench.work / "fill.out", bench.work / "fill.err"
        self._files = [path.open("w") for path in self._logs]
        self._spawn = time.time()
        self._proc = subprocess.Popen(argv, env=bench.env, stdout=self._files[0],
                                      stderr=self._files[1])
        self._ended: tuple[float, int, Any] | None = None
        self._thread = threading.Thread(target=self._reap, daemon=True)
        self._thread.start()

    def _reap(self) -> None:
        _, status, usage = os.wait4(self._proc.pid, 0)
        self._ended = (time.time(), status, usage)

    def result(self) -> dict[str, Any]:
        self._thread.join(_CHILD_TIMEOUT_S)
        for handle in self._files:
            handle.close()
        if self._ended is None:
            self._proc.kill()
            raise RuntimeError("dlo cache fill did not end")
        ended, status, usage = self._ended
        self._proc.returncode = os.waitstatus_to_exitcode(status)
        stdout, stderr = self._logs[0].read_text(), self._logs[1].read_text()
        wall = ended - self._spawn
        rss = round(usage.ru_maxrss / 1024, 1)
        spawn = self._spawn
        if self._proc.returncode:
            raise RuntimeError(
                f"dlo cache fill failed ({self._proc.returncode}): {stderr[-2000:]}")
        summary = json.loads(stdout.strip().splitlines()[-1])
        transfer = _log_time(stderr, _TRANSFER_MARK)
        return {"wall_s": round(wall, 3), "fill_s": summary["seconds"],
                "cached": summary["cached"],
                "start_to_transfer_s": round(transfer - spawn, 3) if transfer else None,
                "peak_rss_mib": rss}


def _loader_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The fill process's start-up and memory, over every cold fill."""
    fills = [r["fill"] for c in ("dlo", "dlo_late") for r in runs[c]]
    starts = [f["start_to_transfer_s"] for f in fills if f["start_to_transfer_s"] is not None]
    exits = [f["wall_s"] - f["fill_s"] for f in fills]
    return {"start_to_first_get_s_median": statistics.median(starts) if starts else None,
            "process_minus_fill_s_median": round(statistics.median(exits), 3),
            "peak_rss_mib_max": max(f["peak_rss_mib"] for f in fills)}


def _phases(spawn: float, marks: dict[str, Any]) -> dict[str, Any]:
    """Marks as seconds since the process was spawned, plus the forward's own time."""
    phases = {k: round(v - spawn, 3) for k, v in marks.items()
              if isinstance(v, float) and v > 1e9}
    phases["forward_s"] = round(marks["forward"] - marks["forward_start"], 3)
    for key in ("resident_bytes_at_forward", "weightless"):
        if key in marks:
            phases[key] = marks[key]
    return phases


def _log_time(stderr: str, mark: str) -> float | None:
    """Epoch time of the first log line containing `mark` (`%(asctime)s` is local time)."""
    for line in stderr.splitlines():
        if mark in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def _equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in page_cache.files_under([directory / "transformer"]))


def _print(report: dict[str, Any], as_json: bool) -> None:
    print(f"cold start, S3 to the end of the first forward, median of {report['rounds']} "
          f"interleaved rounds ({report['cold_cache']} cold cache):")
    for config, seconds in report["median_total_s"].items():
        print(f"  {config:9s} {seconds:6.2f} s")
    for name, ratio in report["ratios"].items():
        goal = report["goals"].get(name)
        verdict = (f" (goal <= {goal['at_most']}: {'met' if goal['met'] else 'NOT met'})"
                   if goal else "")
        print(f"  {name:15s} {ratio:.3f}{verdict}")
    print(f"  first forward s (median): {report['first_forward_s']}")
    print(f"  loader: {report['loader']}")
    print(f"  outputs equal: {report['outputs_equal']}; took {report['benchmark_wall_s']} s")
    if as_json:
        print(json.dumps(report))
