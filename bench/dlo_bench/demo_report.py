"""The verdict of `dlo demo` and its report.

Owns what counts as success: every loader reports `ok` for the same entry and, in multi-reader
mode, the loaders together read the model's bytes from the store exactly once; every runtime rank
served the DiT weightless from the mapped checkpoint; and each rank's offloaded latents equal its
resident latents bit for bit; and `dlo serve` answered one image over HTTP (its step fails the demo
otherwise). Renders the figures as a short text report and as one JSON object.
Called by `dlo_bench.demo` (and by tests directly); it starts nothing and reads no files.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1 << 20
MODES = ("offloaded", "resident")
"""The two runs of every rank; the resident one is the reference."""


@dataclass(frozen=True, kw_only=True)
class OutputComparison:
    """Offloaded against resident latents of one rank."""

    identical: bool
    max_abs_diff: float


def compare_outputs(resident: torch.Tensor, offloaded: torch.Tensor) -> OutputComparison:
    """Bit-for-bit comparison; the largest absolute difference says how far apart they are."""
    if resident.shape != offloaded.shape or resident.dtype != offloaded.dtype:
        return OutputComparison(identical=False, max_abs_diff=float("inf"))
    diff = (resident.double() - offloaded.double()).abs()
    return OutputComparison(identical=torch.equal(resident, offloaded),
                            max_abs_diff=float(diff.max()) if diff.numel() else 0.0)


def loader_problems(summaries: list[dict[str, Any]], model_bytes: int) -> list[str]:
    """What is wrong with the loaders' one-line summaries (contract C2); empty when nothing."""
    problems = [f"loader {s.get('rank')}: {s.get('error', 'status ' + repr(s.get('status')))}"
                for s in summaries if s.get("status") != "ok"]
    if problems:
        return problems
    entries = {s["entry_id"] for s in summaries}
    if len(entries) != 1:
        problems.append(f"loaders filled different entries: {', '.join(sorted(entries))}")
    from_store = sum(s["bytes_from_store"] for s in summaries)
    if from_store != model_bytes:
        problems.append(f"loaders read {from_store} bytes from S3 in all; the model has "
                        f"{model_bytes} bytes and multi-reader mode reads each byte once")
    return problems


def runtime_problems(ranks: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the runtime ranks' figures and comparisons; empty when nothing."""
    problems = []
    for rank in ranks:
        name = f"rank {rank['rank']}"
        if not rank["weightless"] or rank["backing"] != "checkpoint":
            problems.append(f"{name}: the DiT was not served from the mapped entry "
                            f"(weightless={rank['weightless']}, backing={rank['backing']})")
        if not rank["identical"]:
            problems.append(f"{name}: offloaded output differs from the resident output "
                            f"(max abs diff {rank['max_abs_diff']:.3g})")
    return problems


def build_report(*, model: dict[str, Any], loaders: list[dict[str, Any]],
                 ranks: list[dict[str, Any]], served: dict[str, Any], steps: int,
                 seconds: float) -> dict[str, Any]:
    """The JSON report: inputs, figures, `problems` and `status` ("ok" only without problems)."""
    problems = loader_problems(loaders, model["bytes"]) + runtime_problems(ranks)
    return {
        "status": "ok" if not problems else "failed",
        "problems": problems,
        "identical": bool(ranks) and all(r["identical"] for r in ranks),
        "model": model,
        "steps": steps,
        "loaders": loaders,
        "bytes_from_store_total": sum(s.get("bytes_from_store", 0) for s in loaders),
        "ranks": ranks,
        "served": served,
        "seconds": round(seconds, 1),
    }


def format_report(report: dict[str, Any]) -> str:
    """The few lines a person reads after `make demo`."""
    model = report["model"]
    lines = [f"model: {model['class']} ({model['layers']} blocks), {_mib(model['bytes'])} in "
             f"{model['files']} files at {model['source']}"]
    loaders = report["loaders"]
    lines.append(f"cache fill: {len(loaders)} loaders, one per node, "
                 f"{loaders[0].get('mode', '?') if loaders else '?'} mode")
    for node, summary in enumerate(loaders):
        if summary.get("status") == "ok":
            lines.append(f"  node{node}: {_mib(summary['bytes_from_store'])} from S3, "
                         f"{_mib(summary['bytes_from_peers'])} from peers, "
                         f"{_mib(summary['bytes_to_peers'])} to peers, {summary['seconds']:.1f} s")
    lines.append(f"  from S3 in all: {_mib(report['bytes_from_store_total'])} "
                 f"(model: {_mib(model['bytes'])})")
    steps = f"{report['steps']} Euler step{'' if report['steps'] == 1 else 's'}"
    lines.append(f"runtime: {len(report['ranks'])} data-parallel ranks, {steps}; "
                 "offloaded = AllGather over gloo from node0's mapped entry")
    for rank in report["ranks"]:
        for mode in MODES:
            lines.append(f"  rank{rank['rank']} {mode + ':':10} {_run(rank[mode])}")
    verdict = "identical" if report["identical"] else "DIFFERENT"
    lines.append(f"outputs: {verdict} (offloaded vs resident, bit for bit, every rank)")
    served = report["served"]
    lines.append(f"served: one {served['size'][0]}x{served['size'][1]} PNG through `dlo serve` "
                 f"({served['ranks']} ranks, AllGather), POST /v1/images/generations in "
                 f"{served['latency_s']:.2f} s, saved to {served['image']}")
    lines.extend(f"problem: {problem}" for problem in report["problems"])
    lines.append(f"result: {report['status']} in {report['seconds']:.0f} s")
    return "\n".join(lines)


def _run(figures: dict[str, Any]) -> str:
    """PSS at the end of one run, its growth since the process started, the median step."""
    growth = figures["pss_bytes"] - figures["pss_start_bytes"]
    backing = f", backing {figures['backing']}" if "backing" in figures else ""
    return (f"PSS {_mib(figures['pss_bytes'])} (+{_mib(growth)} since start), "
            f"median step {_ms(figures['step_s'])}{backing}")


def _mib(count: int) -> str:
    return f"{count / MIB:.1f} MiB"


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.1f} ms" if seconds else "n/a"
