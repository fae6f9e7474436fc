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
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from dlo_bench import cluster_fault, cluster_nodes, cluster_refill, cluster_report, netns, provenance
from dlo_bench.cluster_nodes import MIB, ClusterBenchError

log = logging.getLogger(__name__)

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
        model_dir = cluster_nodes.write_model(work / "model", args.head_dim)
        digests = cluster_nodes.model_digests(model_dir)
        with netns.cluster(max(nodes), links) as made:
            probe = cluster_nodes.probe_links(made)
            with cluster_nodes.serve_model(made, args.ministack, model_dir) as store:
                runs = [
                    cluster_nodes.fill(made, store, n, mode, work / f"{mode}-{n}", index,
                                       digests, args)
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
