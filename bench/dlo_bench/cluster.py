"""`dlo bench cluster`: multi-node cache fills on simulated nodes with shaped links.

Builds one store namespace and up to N node namespaces (`dlo_bench.netns`), serves a diffusers
checkpoint it writes itself (random weights) from ministack in the store namespace
(`dlo_bench.cluster_store`), then for each node count runs one `dlo cache fill` per node in each
mode, each on empty caches. Every fill is checked before it counts: every rank reports success in
the requested mode and every node's entry is byte-identical to the source. The kernel's own
counters of the shaped links give each node's wire bytes from the store and from its peers, and
the machine's CPU counters how busy the host that simulates them was (`hostcpu`).
Figures, bounds and the plot come from `dlo_bench.cluster_report`. With `--refill-from` or
`--kill-at` it runs `dlo_bench.cluster_refill` (a lone node refilling from holders) or
`dlo_bench.cluster_fault` (a group losing a member mid-fill) instead, on the same helpers.

Without root or iproute2 it says why and exits 0 with no figures. It must not leave namespaces,
servers or cache directories behind: each is removed by the block that made it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlo_bench import cluster_fault, cluster_refill, cluster_report, hostcpu, linkprobe, netns, provenance
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="2,3,4,5,6,7,8",
                        help="comma-separated node counts to run (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(cluster_report.MODES),
                        help="comma-separated loader modes (default: %(default)s)")
    parser.add_argument("--store-mbit", type=float, default=50.0,
                        help="each node's link to the object store, Mbit/s (default: %(default)s)")
    parser.add_argument("--peer-ratios", default="10,40",
                        help="comma-separated peer/store link ratios, each a run of its own: 10 "
                             "is what clusters have, 40 the flattering one (default: "
                             "%(default)s)")
    parser.add_argument("--head-dim", type=int, default=384,
                        help="width of the generated Flux model; 384 gives ~143 MB in bfloat16")
    parser.add_argument("--chunk-bytes", type=int, default=2 * MIB,
                        help="loader chunk size; small enough to balance a small model over 4 "
                             "nodes (default: %(default)s)")
    parser.add_argument("--readers", type=int, default=2,
                        help="concurrent ranged GETs per loader; the loader's memory budget, not "
                             "this, bounds how far it reads ahead (default: %(default)s)")
    parser.add_argument("--ministack", default="ministack", help="ministack executable")
    parser.add_argument("--fill-timeout-s", type=float, default=300.0,
                        help="longest one fill may take before the benchmark fails")
    parser.add_argument("--refill-from", type=int, default=0, metavar="H",
                        help="instead of the group fills: H nodes fill as a group and serve "
                             "the entry, then one more node fills alone from them "
                             "(`cluster_refill`; writes cluster_refill.json)")
    parser.add_argument("--refill-runs", type=int, default=3,
                        help="refills of the lone node from the same holders (default: "
                             "%(default)s)")
    parser.add_argument("--refill-readers", type=int, default=8,
                        help="concurrent chunk reads of the refilling loader (default: "
                             "%(default)s)")
    parser.add_argument("--kill-at", type=float, default=None, metavar="F",
                        help="instead of the group fills: at each node count, a fill without "
                             "fault, then one whose --kill-rank loader is SIGKILLed once the "
                             "loaders' progress reaches this fraction of the bytes they write "
                             "(`cluster_fault`; writes cluster_fault.json)")
    parser.add_argument("--kill-rank", type=int, default=1, metavar="R",
                        help="the rank --kill-at kills (default: %(default)s)")
    parser.add_argument("--peer-timeout", type=float, metavar="S",
                        help="the loaders' --peer-timeout (default: the loader's own): how long "
                             "a silent member goes before the others take it for lost")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy each loader's stdout and stderr here, one folder per fill")
    parser.add_argument("--out", type=Path, help="write cluster.json and cluster.png here")
    parser.add_argument("--json", action="store_true", help="last line: the report as JSON")


def run(args: argparse.Namespace) -> int:
    counts = [n.strip() for n in args.nodes.split(",") if n.strip()]
    nodes = sorted({int(n) for n in counts if n.isdigit()})
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(cluster_report.MODES))
    if unknown or not modes or not nodes or len(nodes) < len(set(counts)) or min(nodes) < 1:
        raise ClusterBenchError(f"--nodes {args.nodes!r} / --modes {args.modes!r} invalid",
                                hint="node counts >= 1; modes from "
                                     + ", ".join(cluster_report.MODES))
    ratios = [r.strip() for r in args.peer_ratios.split(",") if r.strip()]
    reports = {}
    try:
        reason = netns.unavailable_reason()
        if reason is not None:
            raise netns.NetnsUnavailable(reason)
        for ratio in ratios:
            links = netns.LinkConfig(store_mbit=args.store_mbit,
                                     peer_mbit=args.store_mbit * float(ratio))
            if args.refill_from or args.kill_at is not None:
                reports[ratio] = (cluster_refill.measure(args, links) if args.refill_from
                                  else cluster_fault.measure(args, nodes, links))
                print(f"peer/store {ratio}x: {json.dumps(reports[ratio])}", flush=True)
                continue
            reports[ratio] = _measure(args, nodes, modes, links)
            print(f"peer/store {ratio}x:")
            print("\n".join(cluster_report.format_table(reports[ratio])))
    except netns.NetnsUnavailable as exc:
        return _skip(str(exc), as_json=args.json)
    report = {"benchmark": "cluster", "peer_ratios": ratios, "by_peer_ratio": reports}
    if args.refill_from or args.kill_at is not None:
        report["benchmark"] = "cluster_refill" if args.refill_from else "cluster_fault"
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{report['benchmark']}.json"
            path.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {path}")
        if args.json:
            print(json.dumps(report, separators=(",", ":")))
        return 0
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster.json").write_text(json.dumps(report, indent=2) + "\n")
        for ratio, one in reports.items():
            name = "cluster.png" if ratio == ratios[0] else f"cluster-{ratio}x.png"
            cluster_report.plot(one, args.out / name)
            print(f"wrote {args.out / name}")
        print(f"wrote {args.out / 'cluster.json'}")
    if args.json:
        print(json.dumps(report, separators=(",", ":")))
    return 0


def _skip(reason: str, *, as_json: bool) -> int:
    """No namespaces here: say why, print no figures, and succeed (the benchmark is optional)."""
    print(f"dlo bench cluster: skipped, no figures: {reason}")
    if as_json:
        print(json.dumps({"benchmark": "cluster", "skipped": reason}))
    return 0


def _measure(args: argparse.Namespace, nodes: list[int], modes: list[str],
             links: netns.LinkConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dlo-cluster-bench-") as tmp:
        work = Path(tmp)
        model_dir = _write_model(work / "model", args.head_dim)
        digests = model_digests(model_dir)
        with netns.cluster(max(nodes), links) as cluster:
            probe = _probe(cluster)
            with _store(cluster, args.ministack, model_dir) as store:
                runs = [
                    _fill(cluster, store, n, mode, work / f"{mode}-{n}", index, digests, args)
                    for index, (n, mode) in enumerate((n, m) for n in nodes for m in modes)
                ]
    parameters = {
        "nodes": nodes, "modes": modes, "store_mbit": links.store_mbit,
        "peer_mbit": links.peer_mbit, "head_dim": args.head_dim, "chunk_bytes": args.chunk_bytes,
        "readers": args.readers,
        "model": "flux (diffusers FluxTransformer2DModel, 5 blocks, bfloat16, random weights)",
        "command": shlex.join(["dlo", *sys.argv[1:]]),
        "server": "ministack", "server_python": store["python"],
        "fill_time": "slowest rank's own seconds, listing to publication, all ranks released "
                     "together after their imports",
    }
    return cluster_report.build_report(
        model_bytes=store["bytes"], files=len(store["keys"]), runs=runs, parameters=parameters,
        probe=probe, commit=provenance.commit(), machine=provenance.machine(),
    )


def model_digests(model_dir: Path) -> dict[str, str]:
    """Each file's SHA-256 by its name in an entry: the object key relative to the source
    prefix (`transformer/...`), what every node's entry must match."""
    return {p.relative_to(model_dir.parent).as_posix(): sha256_file(p)
            for p in sorted(model_dir.rglob("*")) if p.is_file()}


def _write_model(directory: Path, head_dim: int) -> Path:
    """A Flux DiT in diffusers layout, sharded so that the fill spans several objects."""
    import torch

    from dlo_bench.models import save_diffusers_layout, tiny_model

    model = tiny_model("flux", seed=0, num_layers=5, head_dim=head_dim, dtype=torch.bfloat16)
    return save_diffusers_layout(model, directory, max_shard_bytes=64 * MIB)


def _probe(cluster: netns.Cluster) -> dict[str, Any]:
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
def _store(cluster: netns.Cluster, ministack: str, model_dir: Path) -> Iterator[dict[str, Any]]:
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


def _loader_argv(cluster: netns.Cluster, store: dict[str, Any], *, nodes: int, rank: int,
                 mode: str, root: Path, port: int, args: argparse.Namespace) -> list[str]:
    return cluster.exec_argv(cluster.node_ns[rank], [
        sys.executable, "-c", _LOADER, str(root / "ready"), "cache", "fill",
        "--source", f"s3://{_BUCKET}/{_PREFIX}/", "--endpoint-url", store["endpoint_url"],
        "--region", DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"], "--path-style",
        "--mode", mode, "--chunk-bytes", str(args.chunk_bytes), "--cache-root", str(root / "cache"),
        "--rank", str(rank), "--world-size", str(nodes),
        "--master-addr", cluster.node_addrs[0], "--master-port", str(port),
        "--entry-file", str(root / "entry.json"), "--summary-file", str(root / "summary.json"),
        "--readers", str(args.readers),
        *(["--peer-timeout", f"{args.peer_timeout:g}"] if args.peer_timeout else []),
    ])


def _start_together(procs: list[subprocess.Popen[bytes]], roots: list[Path],
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
        argv = _loader_argv(cluster, store, nodes=len(roots), rank=rank, mode=mode, root=root,
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


def _fill(cluster: netns.Cluster, store: dict[str, Any], nodes: int, mode: str, work: Path,
          index: int, digests: dict[str, str],
          args: argparse.Namespace) -> cluster_report.RunResult:
    """One fill by `nodes` loaders in `mode` on empty caches, checked, then removed."""
    roots = [work / f"node{rank}" for rank in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        launch(cluster, store, roots, mode, index, args, procs)
        before = [netns.node_traffic(cluster, rank) for rank in range(nodes)]
        started = _start_together(procs, roots, args.fill_timeout_s)
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
