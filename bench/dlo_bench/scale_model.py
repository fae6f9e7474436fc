"""`python -m dlo_bench.scale_model`: the fill past one machine, on paper, for 16/64/256 nodes.

Owns a closed-form model of one multi-reader fill, fed with what the benchmarks measured here
(`bench/results/cluster.json`: link efficiencies and the fixed cost of a fill beyond its bound;
`bench/results/loader.json`: how fast one node digests and writes when the store is not the
limit) and with stated assumptions for what one machine cannot show (`ASSUMPTIONS`: per-node NIC,
per-node store throughput, S3's request-rate limit per prefix). For a model of M bytes on N
nodes, each term is a floor the fill cannot beat; the fill takes the largest, plus the measured
fixed cost:

    store      M / (N * R)                 every byte crosses some node's store path once
    requests   (M / part) / GET_RATE       S3 serves GET_RATE GETs per second per prefix
    exchange   broadcast (from one root per chunk, the first design): (N - 1) * M / P
               all-gather (what the loader does, a ring; each rank's chunk
               sent to every other rank moves the same bytes):       (N - 1) / N * M / P
    nic        M / NIC                     every node takes in the whole model (store + peers)

Shown beside them, not in the maximum: `local`, M over the node-local rate this machine measured
(the slower of the loader's digest and the disk write rate); it depends on the node's cores and
disk, not on N, and a busy 2-core test machine would otherwise hide every network term.

`independent` mode (no exchange) is shown next to them: N * M / part GETs share the prefix.
Writes `scale.json` and `scale.md` (the table the README quotes). Must not be imported by the
planes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GB = 1e9
RESULTS = Path(__file__).resolve().parents[1] / "results"
NODES = (8, 16, 64, 256)
ASSUMPTIONS = {
    "model_bytes": 24e9,
    "model": "a 12B-parameter transformer in bfloat16 (Flux-dev class), 24 GB",
    "part_bytes": 16 * 2**20,
    "get_rate_per_prefix": 3500,
    "get_rate_source": "AWS S3: 5,500 GET/HEAD per second per prefix documented; 3,500 taken "
                       "(the PUT figure) as the conservative rate for one checkpoint prefix",
    "nic_gbit": 100.0,
    "store_gbit_per_node": 10.0,
    "peer_gbit": 100.0,
    "notes": "store path per node 10 Gbit/s (S3 per-instance throughput with 16 connections), "
             "peer links at the NIC rate: peer/store 10x, the ratio the cluster benchmark shows",
}


def measured(cluster: dict[str, Any], loader: dict[str, Any]) -> dict[str, float]:
    """What the benchmarks measured that the model uses."""
    probe = cluster.get("link_probe", {})
    rows = [r for r in cluster.get("results", []) if r.get("multi_reader_s") is not None]
    last = max(rows, key=lambda r: r["nodes"]) if rows else None
    fixed = (last["multi_reader_s"] - last["bound_s"]) if last else 0.0
    return {
        "store_link_efficiency": float(probe.get("store_link_efficiency", 1.0)),
        "peer_link_efficiency": float(probe.get("peer_link_efficiency", 1.0)),
        "fixed_seconds": round(max(fixed, 0.0), 3),
        "fixed_seconds_at_nodes": last["nodes"] if last else None,
        "local_bytes_per_s": _local_rate(loader),
    }


def _local_rate(loader: dict[str, Any]) -> float:
    """Bytes per second one node digests and writes: the slower of the disk rate and the
    digest rate (bytes over digest thread-seconds) of the loader benchmark."""
    total = float(loader.get("parameters", {}).get("bytes", 0))
    digest_s = [stage.get("digest", 0.0) for stage in loader.get("stage_seconds", [])]
    rates = [float(loader.get("disk_write_bytes_per_s", 0.0))]
    if total and digest_s and min(digest_s) > 0:
        rates.append(total / min(digest_s))
    rates = [r for r in rates if r > 0]
    return round(min(rates)) if rates else float("inf")


def terms(nodes: int, exchange: str, a: dict[str, Any], m: dict[str, float]) -> dict[str, float]:
    """Each floor of one fill, seconds."""
    size = a["model_bytes"]
    store = a["store_gbit_per_node"] * GB / 8 * m["store_link_efficiency"]
    peer = a["peer_gbit"] * GB / 8 * m["peer_link_efficiency"]
    nic = a["nic_gbit"] * GB / 8 * m["peer_link_efficiency"]
    gets = size / a["part_bytes"]
    share = (nodes - 1) / nodes if exchange == "all_gather" else (nodes - 1)
    return {
        "store": size / (nodes * store),
        "requests": gets / a["get_rate_per_prefix"],
        "exchange": share * size / peer,
        "nic": size / nic,
    }


def row(nodes: int, a: dict[str, Any], m: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    for exchange in ("broadcast", "all_gather"):
        floors = terms(nodes, exchange, a, m)
        binding = max(floors, key=floors.get)
        out[f"{exchange}_s"] = round(floors[binding] + m["fixed_seconds"], 1)
        out[f"{exchange}_bound_by"] = binding
    size, store = a["model_bytes"], a["store_gbit_per_node"] * GB / 8 * m["store_link_efficiency"]
    alone = {"store": size / store,
             "requests": nodes * size / a["part_bytes"] / a["get_rate_per_prefix"]}
    binding = max(alone, key=alone.get)
    out["independent_s"] = round(alone[binding] + m["fixed_seconds"], 1)
    out["independent_bound_by"] = binding
    out["local_s"] = round(size / m["local_bytes_per_s"], 1)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| nodes | broadcast exchange | all-gather exchange | independent "
             "| node-local floor |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['broadcast_s']} s ({r['broadcast_bound_by']}) | "
                     f"{r['all_gather_s']} s ({r['all_gather_bound_by']}) | "
                     f"{r['independent_s']} s ({r['independent_bound_by']}) | "
                     f"{r['local_s']} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where cluster.json/loader.json are read and scale.* written")
    args = parser.parse_args(argv)
    cluster = json.loads((args.results / "cluster.json").read_text())
    cluster = cluster.get("by_peer_ratio", {}).get("10", cluster)
    loader = json.loads((args.results / "loader.json").read_text())
    m = measured(cluster, loader)
    rows = [row(n, ASSUMPTIONS, m) for n in NODES]
    report = {"benchmark": "scale_model", "assumptions": ASSUMPTIONS, "measured": m, "rows": rows}
    (args.results / "scale.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(rows)
    (args.results / "scale.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
