"""`dlo bench cluster --refill-from H`: a lone node refilling its cache from H nodes that hold
the entry, on the same simulated nodes and shaped links as the group fills (`cluster`).

H loaders (nodes 1..H) fill the model as one multi-reader group and stay up as sidecars
(`--keep-running`), serving their entry; then node 0, its cache empty, fills alone, told of the
H holders by a fill-group document (`DLO_FILL_GROUP`), as a pod recreated on a wiped node would
be, `--refill-runs` times (each into an empty cache of its own). Its entry is checked byte for byte against the source. The figures: its fill time (the
summary's, listing to publication) against the bound `model / its peer link`, the bytes its
summary counts from the store and from peers, and the kernel's count of what crossed its store
and peer links. Called by `cluster.run`; removes everything it made, as `cluster` does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dlo_bench import cluster_nodes, netns, provenance
from dlo_bench.s3server import DUMMY_CREDENTIALS
from dlo_contract.cache import sha256_file
from dlo_contract.fill_group import FillGroup, Holder
from dlo_contract.names import (
    DEFAULT_RENDEZVOUS_PORT,
    FILL_GROUP_ENV,
    FILL_SECRET_ENV,
    NODE_NAME_ENV,
)

SERVE_PORT = 9400
"""Each holder's loader endpoint (one per namespace, so the same port on every node)."""
SECRET_FILE = "fill-secret"
"""The fill secret every loader of the run shares, as a DOD's loaders do (peer serving needs it)."""


def measure(args: argparse.Namespace, links: netns.LinkConfig) -> dict[str, Any]:
    """One refill of node 0 from `args.refill_from` holders, checked; its figures."""
    holders = args.refill_from
    with tempfile.TemporaryDirectory(prefix="dlo-cluster-refill-") as tmp:
        work = Path(tmp)
        model_dir = cluster_nodes.write_model(work / "model", args.head_dim)
        (work / SECRET_FILE).write_bytes(os.urandom(32))  # the DOD's: its loaders serve peers
        digests = cluster_nodes.model_digests(model_dir)
        with netns.cluster(holders + 1, links) as nodes, \
                cluster_nodes.serve_model(nodes, args.ministack, model_dir) as store:
            serving = _start_holders(nodes, store, work, args)
            try:  # each run on an empty cache of its own, the holders the same
                runs = [_refill(nodes, store, work / f"node0-run{run}", digests, args)
                        for run in range(args.refill_runs)]
            finally:
                for process in serving:
                    process.send_signal(signal.SIGTERM)
                for process in serving:
                    try:
                        process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
    bound = store["bytes"] * 8 / (links.peer_mbit * 1e6)
    ratios = sorted(run["fill_s"] / bound for run in runs)
    return {
        "holders": holders, "model_bytes": store["bytes"], "store_mbit": links.store_mbit,
        "peer_mbit": links.peer_mbit, "bound_s": round(bound, 3),
        "fill_over_bound": [round(r["fill_s"] / bound, 3) for r in runs],
        "median_fill_over_bound": round(ratios[len(ratios) // 2], 3),
        "bytes_from_store": sum(r["bytes_from_store"] for r in runs),
        "runs": runs, "chunk_bytes": args.chunk_bytes, "head_dim": args.head_dim,
        "command": " ".join(["dlo", *sys.argv[1:]]), "commit": provenance.commit(),
        "machine": provenance.machine(),
    }


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **DUMMY_CREDENTIALS, "GLOO_SOCKET_IFNAME": netns.INTERFACE,
            "OMP_NUM_THREADS": "1", **extra}


def _argv(nodes: netns.Cluster, store: dict[str, Any], node: int, root: Path,
          args: argparse.Namespace, *extra: str) -> list[str]:
    return cluster_nodes.fill_argv(nodes, store, node, root, args,
                                   "--metrics-port", str(SERVE_PORT), *extra)


def _start_holders(nodes: netns.Cluster, store: dict[str, Any], work: Path,
                   args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """Nodes 1..H fill as one group and stay up serving their entry; returns once each
    published (their processes, for the caller to stop)."""
    count = len(nodes.node_ns) - 1
    roots = [work / f"node{n}" for n in range(1, count + 1)]
    procs: list[subprocess.Popen[bytes]] = []
    for rank, root in enumerate(roots):
        root.mkdir(parents=True)
        argv = _argv(nodes, store, rank + 1, root, args, "--rank", str(rank), "--world-size",
                     str(count), "--master-addr", nodes.node_addrs[1], "--master-port",
                     str(DEFAULT_RENDEZVOUS_PORT), "--readers", str(args.readers),
                     "--keep-running")
        env = _env(**{FILL_SECRET_ENV: str(work / SECRET_FILE)})
        with (root / "stdout").open("wb") as out, (root / "stderr").open("wb") as err:
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                          env=env))
    cluster_nodes.start_together(procs, roots, args.fill_timeout_s)
    deadline = time.monotonic() + args.fill_timeout_s
    while not all((root / "entry.json").exists() for root in roots):
        dead = [n + 1 for n, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise cluster_nodes.ClusterBenchError(f"holders {dead or 'all'} did not publish; see "
                                            f"{roots[(dead or [1])[0] - 1] / 'stderr'}")
        time.sleep(0.1)
    return procs


def _refill(nodes: netns.Cluster, store: dict[str, Any], root: Path, digests: dict[str, str],
            args: argparse.Namespace) -> dict[str, Any]:
    """Node 0 fills alone from the holders; its summary's and its links' figures."""
    root.mkdir(parents=True)
    holders = tuple(Holder(f"node{n}", nodes.node_addrs[n], SERVE_PORT)
                    for n in range(1, len(nodes.node_ns)))
    env = _env(**{FILL_GROUP_ENV: FillGroup(holders=holders).to_json(), NODE_NAME_ENV: "node0",
                  FILL_SECRET_ENV: str(root.parent / SECRET_FILE)})
    argv = _argv(nodes, store, 0, root, args, "--readers", str(args.refill_readers))
    with (root / "stdout").open("wb") as out, (root / "stderr").open("wb") as err:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
    before = netns.node_traffic(nodes, 0)
    try:
        cluster_nodes.start_together([process], [root], args.fill_timeout_s)
        code = process.wait(timeout=args.fill_timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    traffic = netns.node_traffic(nodes, 0).minus(before)
    lines = (root / "stdout").read_text(errors="replace").strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if code != 0 or summary.get("status") != "ok" or summary.get("cached"):
        tail = (root / "stderr").read_text(errors="replace")[-1500:]
        raise cluster_nodes.ClusterBenchError(f"the refill of node 0: exit {code}, summary {summary}; "
                                        f"stderr tail:\n{tail}")
    entry = Path(json.loads((root / "entry.json").read_text())["path"])
    for name, digest in digests.items():
        if sha256_file(entry / name) != digest:
            raise cluster_nodes.ClusterBenchError(f"the refill of node 0: {entry / name} differs "
                                            "from the source object")
    return {"fill_s": float(summary["seconds"]),
            "bytes_from_store": int(summary["bytes_from_store"]),
            "bytes_from_peers": int(summary["bytes_from_peers"]),
            "wire_from_store": traffic.from_store, "wire_from_peers": traffic.from_peers,
            "readers": args.refill_readers,
            "stage_seconds": summary.get("stage_seconds", {}),
            "wait_seconds": summary.get("wait_seconds", {})}
