"""What every run of `dlo bench cluster` shares: the model, its store, the links' probe, and
the loaders it launches on the simulated nodes and checks.

Owns writing the checkpoint (random weights, diffusers layout) and its digests, serving it from
ministack in the store namespace (`cluster_store`), probing the shaped links (`linkprobe`),
starting one `dlo cache fill` per node released together, and checking each rank's summary and
entry. Used by `cluster` (fills without fault), `cluster_refill` and `cluster_fault`. Must not
decide the benchmark's goals or write its report (`cluster_report` and the callers do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlo_bench import cluster_report, hostcpu, linkprobe, netns
from dlo_bench.s3server import DUMMY_CREDENTIALS
from dlo_contract.cache import sha256_file
from dlo_contract.errors import PermanentError
from dlo_contract.names import DEFAULT_RENDEZVOUS_PORT

log = logging.getLogger(__name__)

MIB = 1 << 20
_BUCKET = "models"
_PREFIX = "cluster-bench/flux"
_STORE_PORT = 4566


class ClusterBenchError(PermanentError):
    """A fill failed or produced a wrong entry; its figures would mean nothing."""


def model_digests(model_dir: Path) -> dict[str, str]:
    """Each file's SHA-256 by its name in an entry: the object key relative to the source
    prefix (`transformer/...`), what every node's entry must match."""
    return {p.relative_to(model_dir.parent).as_posix(): sha256_file(p)
            for p in sorted(model_dir.rglob("*")) if p.is_file()}


def write_model(directory: Path, head_dim: int) -> Path:
    """A Flux DiT in diffusers layout, sharded so that the fill spans several objects."""
    import torch

    from dlo_bench.models import save_diffusers_layout, tiny_model

    model = tiny_model("flux", seed=0, num_layers=5, head_dim=head_dim, dtype=torch.bfloat16)
    return save_diffusers_layout(model, directory, max_shard_bytes=64 * MIB)


def probe_links(cluster: netns.Cluster) -> dict[str, Any]:
    """Achieved rate of each kind of link, ~2 s per transfer, before any loader is timed."""
    links = cluster.links
    store = linkprobe.measure_mbit(cluster, server_ns=cluster.store_ns,
                               server_addr=cluster.store_addr, client_ns=cluster.node_ns[0],
                               nbytes=int(links.store_mbit * 1e6 / 8 * 2))
    result = {"store_to_node_mbit": round(store, 1),
              "store_link_efficiency": round(store / links.store_mbit, 3)}
    if len(cluster.node_ns) > 1:
        peer = linkprobe.measure_mbit(cluster, server_ns=cluster.node_ns[1],
                                  server_addr=cluster.node_addrs[1], client_ns=cluster.node_ns[0],
                                  nbytes=int(links.peer_mbit * 1e6 / 8 * 2))
        result |= {"node_to_node_mbit": round(peer, 1),
                   "peer_link_efficiency": round(peer / links.peer_mbit, 3)}
    log.info("link probe: %s", result)
    return result


@contextmanager
def serve_model(cluster: netns.Cluster, ministack: str, model_dir: Path) -> Iterator[dict[str, Any]]:
    """ministack in the store namespace holding the model; stopped by closing its stdin."""
    root = model_dir.parent
    binary = Path(shutil.which(ministack) or ministack).absolute()
    if not binary.is_file():
        raise ClusterBenchError(f"ministack executable {ministack} not found",
                                hint="run `make .venv-ministack/.installed` or pass "
                                     "--ministack PATH")
    argv = [sys.executable, "-m", "dlo_bench.cluster_store", "--ministack", str(binary),
            "--host", cluster.store_addr,
            "--port", str(_STORE_PORT), "--bucket", _BUCKET, "--prefix", _PREFIX, str(root)]
    # Closing stdin stops the store; the with block then closes the pipes and reaps it.
    with subprocess.Popen(cluster.exec_argv(cluster.store_ns, argv), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        try:
            line = proc.stdout.readline()
            if not line:
                raise ClusterBenchError(f"the store in {cluster.store_ns} exited with "
                                        f"{proc.wait()} before serving the model")
            yield json.loads(line)
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


# One loader, `dlo cache fill` in-process, started in two steps: imports first (torch, botocore
# and the loader's modules that a fill imports when it needs them, the object store's client
# and the transfer's: seconds of CPU that eight loaders sharing this machine's cores would
# otherwise spend inside the timed fill, where each node spends a fraction of a second on its
# own cores), then a `ready` file, then the fill once a line arrives on stdin. All loaders of a
# fill thus start their clocks together, as on separate nodes. The fill runs as the `dlo`
# command does (its arguments in sys.argv), so it ends as the command does: at once after its
# summary, without the interpreter's teardown, in which a loader that went on without a lost
# member aborts (the retired process group's threads).
_LOADER = """
import importlib, pathlib, sys
import torch.distributed, dlo_loader.cli, dlo_loader.transport, dlo_loader.source
from dlo_loader.fill import TRANSFER_MODULES
for name in TRANSFER_MODULES:
    importlib.import_module(name)
from dlo_cli.main import main
pathlib.Path(sys.argv[1]).touch()
sys.stdin.readline()
sys.argv = ["dlo", *sys.argv[2:]]
sys.exit(main())
"""


def fill_argv(cluster: netns.Cluster, store: dict[str, Any], node: int, root: Path,
              args: argparse.Namespace, *extra: str) -> list[str]:
    """`dlo cache fill` of the model on `node`, started in two steps (`_LOADER`), its cache,
    entry and summary files under `root`; `extra`: the fill's other arguments."""
    return cluster.exec_argv(cluster.node_ns[node], [
        sys.executable, "-c", _LOADER, str(root / "ready"), "cache", "fill",
        "--source", f"s3://{_BUCKET}/{_PREFIX}/", "--endpoint-url", store["endpoint_url"],
        "--region", DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"], "--path-style",
        "--chunk-bytes", str(args.chunk_bytes), "--cache-root", str(root / "cache"),
        "--entry-file", str(root / "entry.json"), "--summary-file", str(root / "summary.json"),
        *extra,
    ])


def loader_argv(cluster: netns.Cluster, store: dict[str, Any], *, nodes: int, rank: int,
                 mode: str, root: Path, port: int, args: argparse.Namespace) -> list[str]:
    """Rank `rank` of a group of `nodes` loaders filling in `mode`."""
    return fill_argv(
        cluster, store, rank, root, args, "--mode", mode, "--rank", str(rank),
        "--world-size", str(nodes), "--master-addr", cluster.node_addrs[0],
        "--master-port", str(port), "--readers", str(args.readers),
        *(["--peer-timeout", f"{args.peer_timeout:g}"] if args.peer_timeout else []),
    )


def start_together(procs: list[subprocess.Popen[bytes]], roots: list[Path],
                    timeout_s: float) -> float:
    """Wait until every loader has imported what it needs, then release all; returns the time."""
    deadline = time.monotonic() + timeout_s
    while not all((root / "ready").exists() for root in roots):
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise ClusterBenchError(f"loaders {dead or 'all'} did not get ready; see "
                                    f"{roots[(dead or [0])[0]] / 'stderr'}")
        time.sleep(0.05)
    started = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.close()
    return started


def launch(cluster: netns.Cluster, store: dict[str, Any], roots: list[Path], mode: str,
           index: int, args: argparse.Namespace,
           procs: list[subprocess.Popen[bytes]]) -> None:
    """Start one loader per root (rank = position), importing, not yet released; appended to
    `procs` as they start, so that the caller's cleanup finds every one."""
    env = {**os.environ, **DUMMY_CREDENTIALS, "GLOO_SOCKET_IFNAME": netns.INTERFACE,
           "OMP_NUM_THREADS": "1"}
    for rank, root in enumerate(roots):
        root.mkdir(parents=True)
        argv = loader_argv(cluster, store, nodes=len(roots), rank=rank, mode=mode, root=root,
                            port=DEFAULT_RENDEZVOUS_PORT + index, args=args)
        with (root / "stdout").open("wb") as out, (root / "stderr").open("wb") as err:
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out,
                                          stderr=err, env=env))


def keep_logs(roots: list[Path], args: argparse.Namespace, name: str) -> None:
    """With --keep-logs: each loader's stdout and stderr, as `name/node<r>.std{out,err}`."""
    if args.keep_logs is None:
        return
    folder = args.keep_logs / name
    folder.mkdir(parents=True, exist_ok=True)
    for root in roots:
        for stream in ("stdout", "stderr"):
            if (root / stream).exists():
                shutil.copyfile(root / stream, folder / f"{root.name}.{stream}")


def fill(cluster: netns.Cluster, store: dict[str, Any], nodes: int, mode: str, work: Path,
          index: int, digests: dict[str, str],
          args: argparse.Namespace) -> cluster_report.RunResult:
    """One fill by `nodes` loaders in `mode` on empty caches, checked, then removed."""
    roots = [work / f"node{rank}" for rank in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        launch(cluster, store, roots, mode, index, args, procs)
        before = [netns.node_traffic(cluster, rank) for rank in range(nodes)]
        started = start_together(procs, roots, args.fill_timeout_s)
        with hostcpu.HostCpuMeter() as host:
            codes = [p.wait(timeout=args.fill_timeout_s) for p in procs]
        wall = time.perf_counter() - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    traffic = [netns.node_traffic(cluster, r).minus(before[r]) for r in range(nodes)]
    keep_logs(roots, args, work.name)
    ranks = tuple(
        check_rank(root, rank, code, mode, digests, traffic[rank])
        for rank, (root, code) in enumerate(zip(roots, codes))
    )
    shutil.rmtree(work)
    run = cluster_report.RunResult(nodes=nodes, mode=mode, ranks=ranks, wall_s=wall,
                                   host_cpu=host.result)
    print(f"N={nodes} {mode}: fill {run.fill_s:.2f} s (processes {wall:.2f} s), store bytes "
          f"per node {[r.wire_from_store for r in ranks]}; host CPU "
          f"{host.result.describe() if host.result else 'not readable'}", flush=True)
    return run


def summary_of(root: Path) -> dict[str, Any]:
    """The loader's one-line JSON summary, the last line of its stdout ({} where none)."""
    lines = (root / "stdout").read_text(errors="replace").strip().splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def check_rank(root: Path, rank: int, code: int, mode: str, digests: dict[str, str],
               traffic: netns.NodeTraffic) -> cluster_report.RankResult:
    """The rank's summary, after checking it succeeded in `mode` with a byte-identical entry."""
    summary = summary_of(root)
    if (code != 0 or summary.get("status") != "ok" or summary.get("mode") != mode
            or summary.get("cached")):
        tail = (root / "stderr").read_text(errors="replace")[-1500:]
        raise ClusterBenchError(f"rank {rank} in {mode} mode: exit {code}, summary {summary}; "
                                f"stderr tail:\n{tail}")
    entry = Path(json.loads((root / "entry.json").read_text())["path"])
    for name, digest in digests.items():
        if sha256_file(entry / name) != digest:
            raise ClusterBenchError(f"rank {rank} in {mode} mode: {entry / name} differs "
                                    "from the source object")
    return cluster_report.RankResult(
        rank=rank, seconds=float(summary["seconds"]),
        bytes_from_store=int(summary["bytes_from_store"]),
        bytes_from_peers=int(summary["bytes_from_peers"]),
        bytes_to_peers=int(summary["bytes_to_peers"]),
        wire_from_store=traffic.from_store, wire_from_peers=traffic.from_peers,
        stage_seconds=dict(summary.get("stage_seconds", {})),
        wait_seconds=dict(summary.get("wait_seconds") or {}),
    )
