"""`dlo bench loader`: single-node fill throughput against a raw parallel-GET ceiling.

Owns the loader benchmark. One ministack server (ranged reads at memory speed) holds a synthetic
checkpoint of valid safetensors files. The ceiling is what this machine can pull from that server
with the same number of concurrent ranged GETs of the same chunk size, discarding the bytes; the
fill is `dlo cache fill`'s code path (one rank) into a fresh cache root, including hashing,
positioned writes, header validation, fsync and publication. A node's other limit is its disk, so
the same run also measures writing and fsyncing the same bytes where the cache goes, through the
loader's own sink (so with the direct writes the loader uses); the checkpoint and the three
kinds of run are `loader_runs`', shared with `loader_schemes` (`--schemes`). Correctness first
(the published files equal the source, digests verified), one warm-up, then ceiling, disk and
fill runs interleaved so drift hits all alike. The figure asked for is `fill_to_ceiling_ratio`
(median fill throughput / median GET ceiling); `fill_to_bound_ratio` divides by the slower of the
GET ceiling and the disk instead. Each run also counts CPU-seconds, of this process (the
ceiling's client, the fill's loader) and of the server, so what a fill costs beyond reading is
visible apart from how the two processes shared the cores, and the whole machine's CPU shares
(`hostcpu`: busy, idle, steal), so a run the host starved is visible as such. `--json` prints
one JSON object as the last line, with the commit, the machine and the parameters (the server's
Python among them: it sets what the server spends per byte). Must not be imported by the planes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import botocore.session
import psutil
from botocore.config import Config
from dlo_loader.fill import FillRequest, fill
from dlo_contract.cache import sha256_file, verify_entry
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings

from dlo_bench import hostcpu, provenance
from dlo_bench.loader_runs import MIB, ceiling_run, measure_disk, timed_fill, write_checkpoint
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server, start_ministack, upload_tree

GIB = 1 << 30
BUCKET = "bench"
PREFIX = "ckpt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--json", action="store_true", help="print one JSON object as the last line")
    add("--ministack", default=".venv-ministack/bin/ministack",
        help="ministack executable (default: %(default)s)")
    add("--size-mib", type=int, default=1024, help="checkpoint size in MiB (default: %(default)s)")
    add("--files", type=int, default=4, help="safetensors files (default: %(default)s)")
    add("--chunk-bytes", type=int, default=16 * MIB, help="default: %(default)s")
    add("--readers", type=int, default=16, help="concurrent ranged GETs (default: %(default)s)")
    add("--repeats", type=int, default=5,
        help="measured runs of each, interleaved; the medians are compared (default: %(default)s)")
    add("--work-dir", help="where the source files and cache roots go (default: a temp dir)")
    add("--output", help="also write the JSON report to this file")
    add("--schemes", help="comma-separated schemes (s3, file, gs, az, https, hf): the same "
        "checkpoint through each scheme's local server in this run, fill against each server's "
        "ceiling (`loader_schemes`), instead of the one S3 report")


def run(args: argparse.Namespace) -> int:
    for name, value in DUMMY_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    work = Path(tempfile.mkdtemp(prefix="dlo-bench-loader-", dir=args.work_dir))
    try:
        if args.schemes:
            from dlo_bench import loader_schemes

            report = loader_schemes.run_schemes(args, args.schemes.split(","), work)
            loader_schemes.print_report(report)
            if args.json:
                print(json.dumps(report), flush=True)
        else:
            with start_ministack(args.ministack) as server:
                report = measure(args, server, work)
            _print(report, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["correct"] else 1


def measure(args: argparse.Namespace, server: S3Server, work: Path) -> dict[str, Any]:
    """The whole report for one server (ministack from `run`; any S3 server works)."""
    digests = write_checkpoint(work / "source", args.size_mib * MIB, args.files)
    upload_tree(server, BUCKET, PREFIX, work / "source")
    total = sum(p.stat().st_size for p in (work / "source").iterdir())
    ranges = _ranges(server, args.chunk_bytes)
    correct, store_checksums = _check_fill(args, server, work / "cache-check", digests)
    meter = _Meter(server)
    _ceiling(server, ranges, args.readers, meter)  # warm-up: connections, server caches
    ceiling_s, disk_s, fill_s, stages = [], [], [], []
    cpu: dict[str, list[dict[str, float]]] = {"ceiling": [], "disk": [], "fill": []}
    host: dict[str, list[hostcpu.HostCpu | None]] = {kind: [] for kind in cpu}
    for repeat in range(args.repeats):
        ceiling_s.append(_ceiling(server, ranges, args.readers, meter))
        cpu["ceiling"].append(meter.cpu)
        host["ceiling"].append(meter.host)
        disk_s.append(measure_disk(work / "disk", total, args.chunk_bytes, meter))
        cpu["disk"].append(meter.cpu)
        host["disk"].append(meter.host)
        seconds, stage_seconds = _fill(args, server, work / f"cache-{repeat}", meter)
        cpu["fill"].append(meter.cpu)
        host["fill"].append(meter.host)
        fill_s.append(seconds)
        stages.append(stage_seconds)
    ceiling = total / statistics.median(ceiling_s)
    disk = total / statistics.median(disk_s)
    fill = total / statistics.median(fill_s)
    return {
        "benchmark": "loader",
        "commit": provenance.commit(),
        "machine": provenance.machine(),
        "parameters": {
            "bytes": total, "files": args.files, "chunk_bytes": args.chunk_bytes,
            "readers": args.readers, "repeats": args.repeats, "server": server.name,
            "server_python": server.python,
            "world_size": 1,
        },
        "correct": correct,
        "store_checksums": store_checksums,
        "ceiling_seconds": [round(s, 4) for s in ceiling_s],
        "fill_seconds": [round(s, 4) for s in fill_s],
        "disk_seconds": [round(s, 4) for s in disk_s],
        "ceiling_bytes_per_s": round(ceiling),
        "disk_write_bytes_per_s": round(disk),
        "fill_bytes_per_s": round(fill),
        "fill_to_ceiling_ratio": round(fill / ceiling, 4),
        "fill_to_bound_ratio": round(fill / min(ceiling, disk), 4),
        "cpu_seconds_per_gib": {
            kind: {side: round(statistics.median(run[side] for run in runs) * GIB / total, 3)
                   for side in ("client", "server")}
            for kind, runs in cpu.items()},
        "cpu_seconds_per_gib_note": "median per run, per GiB moved: client is this process "
                                    "(the ceiling's GETs, the disk probe's writes, the whole "
                                    "fill), server the S3 server's processes",
        "host_cpu": {kind: _median_host(readings) for kind, readings in host.items()},
        "host_cpu_note": "median per run of the whole machine's CPU time: busy (its own "
                         "work), idle, steal (taken by the hypervisor); a run with no idle "
                         "time was bounded by the machine's CPU",
        "stage_seconds": stages,
        "stage_seconds_note": "per fill, thread-seconds summed over the loader's threads: GET "
                              f"({args.readers} readers at once, each hashing what it reads), "
                              "digest (the CRC of chunks received from peers), write (positioned, "
                              "O_DIRECT; alone, by each reader once its piece is in), exchange "
                              "(none alone)",
    }


class _Meter:
    """Over a `with` block: its wall seconds, the CPU-seconds (user + system) this process and
    the server spent in it, and the whole machine's CPU shares (`hostcpu`)."""

    def __init__(self, server: S3Server) -> None:
        self._server = psutil.Process(server.process.pid)
        self.seconds = 0.0
        self.cpu: dict[str, float] = {}
        self.host: hostcpu.HostCpu | None = None
        self._host = hostcpu.HostCpuMeter()
        self._started: tuple[float, dict[str, float]] = (0.0, {})

    def __enter__(self) -> _Meter:
        self._started = (time.perf_counter(), self._cpu_now())
        self._host.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        began, before = self._started
        self.seconds = time.perf_counter() - began
        after = self._cpu_now()
        self._host.__exit__(*exc)
        self.host = self._host.result
        self.cpu = {side: round(after[side] - before[side], 4) for side in after}

    def _cpu_now(self) -> dict[str, float]:
        server = 0.0
        for process in (self._server, *self._server.children(recursive=True)):
            with contextlib.suppress(psutil.Error):  # a child that just ended
                times = process.cpu_times()
                server += times.user + times.system
        return {"client": time.process_time(), "server": server}


def _median_host(readings: list[hostcpu.HostCpu | None]) -> dict[str, float] | None:
    """Each share's median over the runs that could read the counters; None if none could."""
    read = [reading.as_dict() for reading in readings if reading is not None]
    if not read:
        return None
    return {share: round(statistics.median(r[share] for r in read), 3) for share in read[0]}


def _ranges(server: S3Server, chunk_bytes: int) -> list[tuple[str, int, int]]:
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")
    return [(item["Key"], start, min(chunk_bytes, item["Size"] - start))
            for item in listing["Contents"] for start in range(0, item["Size"], chunk_bytes)]


def s3_get(server: S3Server, readers: int) -> Callable[[str, int, int], int]:
    """A ranged GET of (key, start, length), its body read a MiB at a time and dropped, through
    a client from a fresh botocore session, as the loader's is (a fresh process has no service
    model loaded), with a pool of `readers` connections, as the loader's."""
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint_url,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=readers))

    def get(key: str, start: int, length: int) -> int:
        body = client.get_object(Bucket=BUCKET, Key=key,
                                 Range=f"bytes={start}-{start + length - 1}")["Body"]
        got = 0
        while piece := body.read(MIB):
            got += len(piece)
        return got

    return get


def _ceiling(server: S3Server, ranges: list[tuple[str, int, int]], readers: int,
             meter: _Meter) -> float:
    """Seconds to GET every range with `readers` threads (`s3_get`), from creating the client on
    (the fill's time includes its client too)."""
    return ceiling_run(lambda: s3_get(server, readers), ranges, readers, meter, "ceiling run")


def _settings(args: argparse.Namespace, server: S3Server, root: Path) -> Settings:
    return Settings(
        loader=LoaderConfig(source=f"s3://{BUCKET}/{PREFIX}/", endpoint_url=server.endpoint_url,
                            path_style=True, chunk_bytes=args.chunk_bytes, readers=args.readers),
        cache=CacheConfig(root=str(root)),
    )


def _fill(args: argparse.Namespace, server: S3Server, root: Path,
          meter: _Meter) -> tuple[float, dict[str, float]]:
    """Seconds for one complete fill (list, read, hash, write, validate, publish), and where
    the loader's threads spent them."""
    result = timed_fill(_settings(args, server, root), meter)
    return meter.seconds, {k: round(v, 3) for k, v in (result.stage_seconds or {}).items()}


def _check_fill(args: argparse.Namespace, server: S3Server, root: Path,
                digests: dict[str, str]) -> tuple[bool, str]:
    """One fill whose published files must hash to the source's digests (and verify fully);
    and whether it checked the bytes against the store's checksums (its summary's word)."""
    result = fill(FillRequest(settings=_settings(args, server, root)))
    published = {name: sha256_file(Path(result.path) / name) for name in digests}
    good = published == digests and not verify_entry(root, result.entry_id, full=True)
    shutil.rmtree(root)
    return good, result.summary().store_checksums


def _print(report: dict[str, Any], as_json: bool) -> None:
    print(f"correct: {report['correct']}; store checksums checked: {report['store_checksums']}")
    print(f"ceiling (raw parallel GETs): {report['ceiling_bytes_per_s'] / 1e9:.3f} GB/s "
          f"(runs: {report['ceiling_seconds']} s)")
    print(f"fill (dlo cache fill, 1 rank): {report['fill_bytes_per_s'] / 1e9:.3f} GB/s "
          f"(runs: {report['fill_seconds']} s)")
    print(f"disk write+fsync where the cache goes: {report['disk_write_bytes_per_s'] / 1e9:.3f} "
          f"GB/s (runs: {report['disk_seconds']} s)")
    cpu = report["cpu_seconds_per_gib"]
    print("CPU-seconds per GiB (this process / the server): " + ", ".join(
        f"{kind} {sides['client']:.2f} / {sides['server']:.2f}" for kind, sides in cpu.items()))
    host = report["host_cpu"]
    print("machine CPU, median per run: " + ", ".join(
        f"{kind} " + (f"idle {shares['idle']:.0%} steal {shares['steal']:.0%}" if shares
                      else "not readable") for kind, shares in host.items()))
    print(f"where the fill's time went (thread-seconds per run): {report['stage_seconds']}")
    print(f"fill_to_ceiling_ratio: {report['fill_to_ceiling_ratio']:.3f}; fill_to_bound_ratio "
          f"(against the slower of GETs and disk): {report['fill_to_bound_ratio']:.3f}")
    if as_json:
        print(json.dumps(report), flush=True)
