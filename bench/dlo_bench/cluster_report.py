"""Figures of the simulated multi-node benchmark: bounds, ratios, the report and its plot.

Pure arithmetic and report assembly for `dlo bench cluster` (`dlo_bench.cluster` measures, this
module judges), so that the tests can check it without namespaces or servers. It must not start
processes or touch the network. The plot uses matplotlib's Agg backend (no display).

The bounds, for a model of M bytes, N nodes, store link R and peer link P (bytes/s):

    store bound      M / (N * R)        the store links together must carry every byte once
    peer-link bound  (N - 1) * M / (N * P)   each node receives the other N - 1 shares on its link
    bound            the larger of the two: no schedule of a multi-reader fill beats it
    one-link bound   M / R              what a single node reading everything alone needs

Fill time is the slowest rank's own `seconds` (the loader's work from listing through rendezvous
to publication). The loaders are started with their imports done and released together, so
interpreter and torch start-up, which on one shared machine would serialize across the simulated
nodes, are no part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlo_bench.hostcpu import HostCpu

MODES = ("multi-reader", "single-reader", "independent")
GOAL_NODES = 8
GOAL_TO_BOUND = 1.2
"""At GOAL_NODES, multi-reader fill time at most this multiple of the bound."""
GOAL_TO_INDEPENDENT = 0.4
"""At GOAL_NODES, multi-reader fill time below this fraction of independent fill time."""


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """One loader's summary line plus the kernel's count of its node's wire bytes."""

    rank: int
    seconds: float
    bytes_from_store: int
    bytes_from_peers: int
    bytes_to_peers: int
    wire_from_store: int
    wire_from_peers: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Where the rank's time went (the summary's `stage_seconds`: GET, digest, write, exchange)."""
    wait_seconds: dict[str, float] = field(default_factory=dict)
    """What the rank waited for before its transfer (the summary's `wait_seconds`: the group,
    its turn in the node order, the publication, room)."""


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One fill: N loaders in one mode."""

    nodes: int
    mode: str
    ranks: tuple[RankResult, ...]
    wall_s: float
    """From releasing the (already imported) loaders to the exit of the last one."""
    host_cpu: HostCpu | None = None
    """The whole machine's CPU over `wall_s` (None where unreadable): whether the host that
    simulates the nodes had room to spare (see [Note: steal] in `dlo_bench.hostcpu`)."""

    @property
    def fill_s(self) -> float:
        return max(rank.seconds for rank in self.ranks)


@dataclass(frozen=True, kw_only=True)
class Bounds:
    store_s: float
    peer_link_s: float
    one_link_s: float

    @property
    def bound_s(self) -> float:
        return max(self.store_s, self.peer_link_s)


def bounds(model_bytes: int, nodes: int, *, store_mbit: float, peer_mbit: float) -> Bounds:
    """The lower bounds above, in seconds, for link rates given in Mbit/s."""
    if nodes < 1 or store_mbit <= 0 or peer_mbit <= 0:
        raise ValueError(f"need nodes >= 1 and positive rates, got {nodes=} {store_mbit=} "
                         f"{peer_mbit=}")
    store = store_mbit * 1e6 / 8
    peer = peer_mbit * 1e6 / 8
    return Bounds(
        store_s=model_bytes / (nodes * store),
        peer_link_s=(nodes - 1) * model_bytes / (nodes * peer),
        one_link_s=model_bytes / store,
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def summarize(model_bytes: int, runs: Sequence[RunResult], *, store_mbit: float,
              peer_mbit: float) -> list[dict[str, Any]]:
    """One row per node count: fill time per mode, the bounds and the ratios between them."""
    rows = []
    for nodes in sorted({run.nodes for run in runs}):
        fill = {run.mode: run.fill_s for run in runs if run.nodes == nodes}
        host = next((run.host_cpu for run in runs
                     if run.nodes == nodes and run.mode == MODES[0]), None)
        b = bounds(model_bytes, nodes, store_mbit=store_mbit, peer_mbit=peer_mbit)
        multi, single, alone = (fill.get(mode) for mode in MODES)
        rows.append({
            "nodes": nodes,
            "multi_reader_s": multi,
            "single_reader_s": single,
            "independent_s": alone,
            "store_bound_s": round(b.store_s, 3),
            "peer_link_bound_s": round(b.peer_link_s, 3),
            "bound_s": round(b.bound_s, 3),
            "one_link_bound_s": round(b.one_link_s, 3),
            "multi_reader_to_bound_ratio": _ratio(multi, b.bound_s),
            "multi_reader_to_independent_ratio": _ratio(multi, alone),
            "multi_reader_to_single_reader_ratio": _ratio(multi, single),
            "single_reader_to_one_link_bound_ratio": _ratio(single, b.one_link_s),
            "independent_to_one_link_bound_ratio": _ratio(alone, b.one_link_s),
            "multi_reader_host_cpu": host.as_dict() if host else None,
        })
    return rows


def goal(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goal at GOAL_NODES, judged from the summary rows (None where not measured)."""
    row = next((r for r in rows if r["nodes"] == GOAL_NODES), None)
    to_bound = row["multi_reader_to_bound_ratio"] if row else None
    to_independent = row["multi_reader_to_independent_ratio"] if row else None
    return {
        "nodes": GOAL_NODES,
        "multi_reader_to_bound_max": GOAL_TO_BOUND,
        "multi_reader_to_independent_max": GOAL_TO_INDEPENDENT,
        "multi_reader_to_bound_ratio": to_bound,
        "multi_reader_to_independent_ratio": to_independent,
        "bound_met": None if to_bound is None else to_bound <= GOAL_TO_BOUND,
        "independent_met": None if to_independent is None else to_independent < GOAL_TO_INDEPENDENT,
    }


def build_report(*, model_bytes: int, files: int, runs: Sequence[RunResult],
                 parameters: dict[str, Any], probe: dict[str, Any], commit: str | None,
                 machine: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one benchmark run as one JSON-ready object."""
    rows = summarize(model_bytes, runs, store_mbit=parameters["store_mbit"],
                     peer_mbit=parameters["peer_mbit"])
    return {
        "benchmark": "cluster",
        "commit": commit,
        "machine": machine,
        "parameters": parameters,
        "model_bytes": model_bytes,
        "model_files": files,
        "link_probe": probe,
        "results": rows,
        "goal": goal(rows),
        "runs": [
            {"nodes": run.nodes, "mode": run.mode, "fill_s": run.fill_s,
             "wall_s": round(run.wall_s, 3),
             "host_cpu": run.host_cpu.as_dict() if run.host_cpu else None,
             "ranks": [asdict(rank) for rank in run.ranks]}
            for run in runs
        ],
    }


def format_table(report: dict[str, Any]) -> list[str]:
    """The report as the lines a person reads: fill seconds per mode, the bound, the ratios, and
    how idle the host was and how much the hypervisor took during the multi-reader fill."""
    lines = [f"model {report['model_bytes'] / 1e6:.1f} MB in {report['model_files']} objects; "
             f"measured links {report['link_probe']}",
             f"{'N':>2} {'multi':>7} {'single':>7} {'indep':>7} {'bound':>7} "
             f"{'multi/bound':>11} {'multi/indep':>11} {'idle':>5} {'steal':>5}"]
    for row in report["results"]:
        cells = [row["multi_reader_s"], row["single_reader_s"], row["independent_s"],
                 row["bound_s"]]
        text = " ".join(f"{c:7.2f}" if c is not None else f"{'-':>7}" for c in cells)
        ratios = [row["multi_reader_to_bound_ratio"], row["multi_reader_to_independent_ratio"]]
        host = row.get("multi_reader_host_cpu")
        shares = (f"{host['idle']:5.0%} {host['steal']:5.0%}" if host
                  else f"{'-':>5} {'-':>5}")
        lines.append(f"{row['nodes']:>2} {text} " + " ".join(f"{str(r):>11}" for r in ratios)
                     + f" {shares}")
    g = report["goal"]
    lines.append(f"goal at N={g['nodes']}: multi-reader/bound {g['multi_reader_to_bound_ratio']} "
                 f"(<= {g['multi_reader_to_bound_max']}: {g['bound_met']}), multi-reader/"
                 f"independent {g['multi_reader_to_independent_ratio']} "
                 f"(< {g['multi_reader_to_independent_max']}: {g['independent_met']})")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    """Fill time per mode against the bounds (left) and the goal ratios (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = report["results"]
    nodes = [row["nodes"] for row in rows]
    params = report["parameters"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    for mode, marker in zip(MODES, "osD"):
        key = mode.replace("-", "_") + "_s"
        left.plot(nodes, [row[key] for row in rows], marker=marker, label=mode)
    left.plot(nodes, [row["bound_s"] for row in rows], "k--",
              label="bound max(M/(N·R), (N−1)·M/(N·P))")
    left.plot(nodes, [row["one_link_bound_s"] for row in rows], "k:", label="one link M/R")
    left.set(xlabel="nodes N", ylabel="fill time (s)", xticks=nodes, ylim=(0, None),
             title=f"Fill time, {report['model_bytes'] / 1e6:.0f} MB, R = {params['store_mbit']:g}"
                   f" Mbit/s, peers {params['peer_mbit']:g} Mbit/s")
    left.legend(fontsize=8)
    right.plot(nodes, [row["multi_reader_to_bound_ratio"] for row in rows], "o-",
               label="multi-reader / bound")
    right.plot(nodes, [row["multi_reader_to_independent_ratio"] for row in rows], "s-",
               label="multi-reader / independent")
    right.axhline(GOAL_TO_BOUND, color="C0", linestyle=":",
                  label=f"goal ≤ {GOAL_TO_BOUND} at N={GOAL_NODES}")
    right.axhline(GOAL_TO_INDEPENDENT, color="C1", linestyle=":",
                  label=f"goal < {GOAL_TO_INDEPENDENT} at N={GOAL_NODES}")
    ratios = [r for row in rows for r in (row["multi_reader_to_bound_ratio"],
                                          row["multi_reader_to_independent_ratio"]) if r]
    right.set(xlabel="nodes N", ylabel="ratio", xticks=nodes,
              ylim=(0, max([GOAL_TO_BOUND * 1.15, *(r * 1.1 for r in ratios)])),
              title="Multi-reader against the bound and against independent")
    right.legend(fontsize=8)
    machine = report.get("machine") or {}
    fig.text(0.01, 0.005, f"{machine.get('cpus', '?')} × {machine.get('cpu', '?')}, "
             f"{machine.get('memory_gib', '?')} GiB, Linux {machine.get('kernel', '?')}; nodes are "
             f"network namespaces with htb-shaped links; commit {(report.get('commit') or '?')[:12]}",
             fontsize=7, color="0.4")
    fig.get_layout_engine().set(rect=(0, 0.03, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
