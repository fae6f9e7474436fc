"""The cluster benchmark's arithmetic, report, skip path, and namespace lifecycle."""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import pytest

from dlo_bench import cluster, cluster_fault, cluster_nodes, cluster_report, hostcpu, linkprobe, netns
from dlo_bench.cluster_report import RankResult, RunResult
from dlo_contract.cache import sha256_file


def _rank(rank: int, seconds: float) -> RankResult:
    return RankResult(rank=rank, seconds=seconds, bytes_from_store=100, bytes_from_peers=300,
                      bytes_to_peers=300, wire_from_store=105, wire_from_peers=315)


def _run(nodes: int, mode: str, *seconds: float,
         host_cpu: hostcpu.HostCpu | None = None) -> RunResult:
    return RunResult(nodes=nodes, mode=mode, wall_s=max(seconds) + 3, host_cpu=host_cpu,
                     ranks=tuple(_rank(i, s) for i, s in enumerate(seconds)))


def test_bounds_store_limited() -> None:
    # 1 GB, 4 nodes, 200 Mbit/s = 25 MB/s to the store, 2 Gbit/s = 250 MB/s between nodes.
    b = cluster_report.bounds(10**9, 4, store_mbit=200, peer_mbit=2000)
    assert b.store_s == pytest.approx(10.0)
    assert b.peer_link_s == pytest.approx(3.0)
    assert b.one_link_s == pytest.approx(40.0)
    assert b.bound_s == pytest.approx(10.0)


def test_bound_is_the_peer_link_when_peers_are_slower() -> None:
    b = cluster_report.bounds(10**9, 2, store_mbit=1000, peer_mbit=100)
    assert b.store_s == pytest.approx(4.0)
    assert b.peer_link_s == pytest.approx(40.0)
    assert b.bound_s == pytest.approx(40.0)


def test_single_node_has_no_peer_traffic() -> None:
    b = cluster_report.bounds(10**9, 1, store_mbit=200, peer_mbit=2000)
    assert b.peer_link_s == 0
    assert b.bound_s == pytest.approx(b.one_link_s)


def test_fill_time_is_the_slowest_rank() -> None:
    assert _run(3, "multi-reader", 4.0, 6.5, 5.0).fill_s == 6.5


def test_report_ratios_and_goal() -> None:
    model = 10**9  # bound at N=8: 5 s; one link: 40 s
    saturated = hostcpu.HostCpu(busy=0.62, idle=0.05, steal=0.33)
    runs = [_run(8, "multi-reader", 5.5, 5.9, 5.0, 5.5, host_cpu=saturated),
            _run(8, "single-reader", 41, 40, 40, 40),
            _run(8, "independent", 40.0, 44.0, 42.0, 41.0), _run(2, "multi-reader", 21.0, 22.0)]
    report = cluster_report.build_report(
        model_bytes=model, files=3, runs=runs, parameters={"store_mbit": 200, "peer_mbit": 2000},
        probe={"store_to_node_mbit": 191.0}, commit="abc", machine={"cores": 2},
    )
    two, eight = report["results"]
    assert two["nodes"] == 2 and two["bound_s"] == 20.0
    assert two["multi_reader_to_bound_ratio"] == 1.1
    assert two["independent_s"] is None and two["multi_reader_to_independent_ratio"] is None
    assert eight["multi_reader_s"] == 5.9
    assert eight["multi_reader_to_bound_ratio"] == 1.18
    assert eight["multi_reader_to_independent_ratio"] == round(5.9 / 44.0, 3)
    assert eight["single_reader_to_one_link_bound_ratio"] == round(41 / 40, 3)
    assert report["goal"]["bound_met"] is True and report["goal"]["independent_met"] is True
    assert report["runs"][0]["ranks"][1]["seconds"] == 5.9
    assert report["runs"][0]["host_cpu"] == {"busy": 0.62, "idle": 0.05, "steal": 0.33}
    assert eight["multi_reader_host_cpu"] == report["runs"][0]["host_cpu"]
    assert two["multi_reader_host_cpu"] is None  # not measured: said, not guessed
    assert report["commit"] == "abc" and report["machine"] == {"cores": 2}
    json.dumps(report)  # every figure is JSON-ready
    lines = cluster_report.format_table(report)
    assert lines[2] == " 2   22.00       -       -   20.00         1.1        None     -     -"
    assert lines[3] == " 8    5.90   41.00   44.00    5.00        1.18       0.134    5%   33%"
    assert lines[-1] == ("goal at N=8: multi-reader/bound 1.18 (<= 1.2: True), "
                         "multi-reader/independent 0.134 (< 0.4: True)")


def test_host_cpu_shares_come_from_the_kernel_counters(tmp_path: Path) -> None:
    # user nice system idle iowait irq softirq steal (guest fields after them are ignored)
    before = (100, 0, 50, 800, 10, 0, 5, 35)
    after = (160, 0, 70, 815, 15, 0, 10, 75)  # +60 +0 +20 +15 +5 +0 +5 +40 = 145 ticks
    shares = hostcpu.between(before, after)
    assert shares == pytest.approx(hostcpu.HostCpu(busy=85 / 145, idle=20 / 145, steal=40 / 145))
    assert shares.describe() == "busy 59%, idle 14%, steal 28%"
    assert hostcpu.between(before, before) is None and hostcpu.between(None, after) is None
    stat = tmp_path / "stat"
    stat.write_text("cpu  160 0 70 815 15 0 10 75 0 0\ncpu0 80 0 35 400 7 0 5 37 0 0\n")
    assert hostcpu.read_times(stat) == after
    stat.write_text("cpu  160 0 70 815 15 0 10\n")  # a kernel before steal was counted
    assert hostcpu.read_times(stat) == (*after[:7], 0)
    assert hostcpu.read_times(tmp_path / "absent") is None


def test_host_cpu_meter_sees_this_machine_work() -> None:
    if hostcpu.read_times() is None:
        pytest.skip("no /proc/stat here")
    with hostcpu.HostCpuMeter() as meter:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # one CPU busy for 0.3 s
            pass
    assert meter.result is not None and meter.result.busy > 0
    assert sum(meter.result.as_dict().values()) == pytest.approx(1, abs=0.01)


def test_goal_missed_and_goal_unmeasured() -> None:
    rows = cluster_report.summarize(10**9, [_run(8, "multi-reader", 14.0), _run(8, "independent", 30.0)],
                                    store_mbit=200, peer_mbit=2000)
    missed = cluster_report.goal(rows)
    assert missed["bound_met"] is False and missed["independent_met"] is False
    unmeasured = cluster_report.goal(cluster_report.summarize(
        10**9, [_run(2, "multi-reader", 14.0)], store_mbit=200, peer_mbit=2000))
    assert unmeasured["bound_met"] is None and unmeasured["multi_reader_to_bound_ratio"] is None


def test_plot_writes_a_png(tmp_path: Path) -> None:
    runs = [_run(n, mode, s * 4 / n) for n in (2, 3, 4) for mode, s in
            (("multi-reader", 12.0), ("single-reader", 40.0 * n / 4), ("independent", 40.0 * n / 4))]
    report = cluster_report.build_report(
        model_bytes=10**9, files=3, runs=runs, parameters={"store_mbit": 200, "peer_mbit": 2000},
        probe={}, commit=None, machine={},
    )
    cluster_report.plot(report, tmp_path / "out" / "cluster.png")
    assert (tmp_path / "out" / "cluster.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cluster.add_arguments(parser)
    args = parser.parse_args(["--json"])
    vars(args).update(overrides)
    return args


def test_without_namespaces_it_says_why_and_exits_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "network namespaces need root")
    assert cluster.run(_args()) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "dlo bench cluster: skipped, no figures: network namespaces need root"
    assert json.loads(lines[-1]) == {"benchmark": "cluster", "skipped": "network namespaces need root"}


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(cluster_nodes.ClusterBenchError) as info:
        cluster.run(_args(modes="multi-reader,broadcast"))
    assert str(info.value) == "--nodes '2,3,4,5,6,7,8' / --modes 'multi-reader,broadcast' invalid"
    with pytest.raises(cluster_nodes.ClusterBenchError) as info:
        cluster.run(_args(nodes="2,four"))
    assert str(info.value).startswith("--nodes '2,four' / --modes")


def _rank_dir(root: Path, summary: dict[str, object], entry: Path) -> None:
    root.mkdir(parents=True)
    (root / "stdout").write_text("progress 10%\n" + json.dumps(summary) + "\n")
    (root / "stderr").write_text("")
    (root / "entry.json").write_text(json.dumps({"path": str(entry)}))


def test_a_fill_that_fell_back_to_another_mode_does_not_count(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "a.safetensors").write_bytes(b"abc")
    summary = {"status": "ok", "mode": "independent", "seconds": 1.0, "bytes_from_store": 3,
               "bytes_from_peers": 0, "bytes_to_peers": 0}
    _rank_dir(tmp_path / "n0", summary, entry)
    traffic = netns.NodeTraffic(from_store=3, from_peers=0, to_store=0, to_peers=0)
    digests = {"a.safetensors": sha256_file(entry / "a.safetensors")}
    with pytest.raises(cluster_nodes.ClusterBenchError, match="rank 0 in multi-reader mode: exit 0"):
        cluster_nodes.check_rank(tmp_path / "n0", 0, 0, "multi-reader", digests, traffic)
    ok = cluster_nodes.check_rank(tmp_path / "n0", 0, 0, "independent", digests, traffic)
    assert ok.bytes_from_store == 3 and ok.wire_from_store == 3
    (entry / "a.safetensors").write_bytes(b"abd")
    with pytest.raises(cluster_nodes.ClusterBenchError) as info:
        cluster_nodes.check_rank(tmp_path / "n0", 0, 0, "independent", digests, traffic)
    assert str(info.value) == f"rank 0 in independent mode: {entry / 'a.safetensors'} differs from the source object"


def test_cluster_leaves_no_namespace_behind(namespaces: None) -> None:
    links = netns.LinkConfig(store_mbit=200, peer_mbit=2000)
    with pytest.raises(RuntimeError, match="inside the block"):
        with netns.cluster(2, links) as made:
            assert set(made.namespaces) <= set(netns.list_namespaces())
            assert len(made.namespaces) == 4  # switch, store, two nodes
            raise RuntimeError("inside the block")
    assert not set(made.namespaces) & set(netns.list_namespaces())


def test_kernel_counters_tell_store_traffic_from_peer_traffic(namespaces: None) -> None:
    with netns.cluster(2, netns.LinkConfig(store_mbit=800, peer_mbit=2000)) as made:
        before = netns.node_traffic(made, 0)
        linkprobe.measure_mbit(made, server_ns=made.store_ns, server_addr=made.store_addr,
                           client_ns=made.node_ns[0], nbytes=2_000_000)
        linkprobe.measure_mbit(made, server_ns=made.node_ns[1], server_addr=made.node_addrs[1],
                           client_ns=made.node_ns[0], nbytes=3_000_000)
        seen = netns.node_traffic(made, 0).minus(before)
    assert 2_000_000 < seen.from_store < 2_300_000
    assert 3_000_000 < seen.from_peers < 3_400_000
    assert seen.to_store < 200_000 and seen.to_peers < 200_000
    assert not set(made.namespaces) & set(netns.list_namespaces())


def test_fault_progress_is_the_loaders_bytes_written_over_all_they_write() -> None:
    page = ("# HELP dlo_loader_bytes_done_bytes Bytes of this node's entry written so far.\n"
            "dlo_loader_bytes_done_bytes 3e+06\ndlo_loader_bytes_total_bytes 8000000.0\n"
            'dlo_loader_store_retries_total{reason="throttled"} 2.0\n'
            "dlo_loader_bytes_from_store_total 1000000.0\n")
    seen = cluster_fault.parse_metrics(page)
    assert seen == {"done": 3e6, "total": 8e6, "from_store": 1e6}
    assert cluster_fault.fraction_done([seen, {}]) is None  # a loader not listed yet
    assert cluster_fault.fraction_done([seen, {"done": 5e6, "total": 8e6}]) == 0.5


def test_fault_figures_against_the_fill_without_fault() -> None:
    kill = cluster_fault.Kill(rank=2, at_fraction=0.51, after_s=3.0, from_store_before=200,
                              at_unix=0.0)
    figures = cluster_fault.judge(1000, 10.0, 1040, kill=kill, survivors=[_rank(0, 12.0),
                                  _rank(1, 12.5)], wire_from_store=1250, regrouped_after_s=2.5)
    assert figures["regrouped_after_kill_s"] == 2.5
    assert figures["nodes"] == 3 and figures["survivors_publish_s"] == 12.5
    assert figures["survivors_publish_over_no_fault"] == 1.25
    assert figures["store_bytes_over_model"] == 1.25
    assert figures["no_fault_store_bytes_over_model"] == 1.04
    assert figures["store_payload_over_model"] == 0.4  # 100 + 100 + 200 of 1000
    assert figures["goal"] == {"survivors_publish_over_no_fault_max": 1.3,
                               "store_bytes_over_model_max": 1.2, "publish_met": True,
                               "store_met": False}


def test_fault_regroup_delay_is_read_from_the_survivors_logs(tmp_path: Path) -> None:
    roots = [tmp_path / f"node{rank}" for rank in range(3)]
    for root in roots:
        root.mkdir()
    line = "WARNING dlo_loader.regroup: [rank {r}/3] the group continues without loader rank 1"
    (roots[0] / "stderr").write_text(f"2026-12-03 10:00:01,000 INFO x: plan\n"
                                     f"2026-12-03 10:00:04,250 {line.format(r=0)}\n")
    (roots[2] / "stderr").write_text(f"2026-12-03 10:00:05,500 {line.format(r=2)}\n")
    at = datetime.datetime(2026, 12, 3, 10, 0, 2).timestamp()
    kill = cluster_fault.Kill(rank=1, at_fraction=0.5, after_s=1.0, from_store_before=0,
                              at_unix=at)
    assert cluster_fault.regrouped_after(roots, kill) == 3.5  # the later survivor's
    (roots[2] / "stderr").write_text("2026-12-03 10:00:05,500 INFO x: published\n")
    assert cluster_fault.regrouped_after(roots, kill) is None


def test_fault_kill_arguments_are_checked() -> None:
    with pytest.raises(cluster_nodes.ClusterBenchError) as info:
        cluster_fault.measure(_args(kill_at=0.5, kill_rank=3), [3], netns.LinkConfig(
            store_mbit=50, peer_mbit=500))
    assert str(info.value) == "--kill-at 0.5 / --kill-rank 3 invalid"


def test_a_group_that_loses_a_member_mid_fill_publishes_on_the_survivors(
        namespaces: None, ministack: Path, tmp_path: Path) -> None:
    args = _args(nodes="2", kill_at=0.5, kill_rank=1, head_dim=128, store_mbit=20.0,
                 peer_ratios="10", chunk_bytes=1 << 20, peer_timeout=2.0,
                 ministack=str(ministack), out=tmp_path, json=False)
    assert cluster.run(args) == 0
    report = json.loads((tmp_path / "cluster_fault.json").read_text())
    (figures,) = report["by_peer_ratio"]["10"]["results"]
    assert figures["kill"]["rank"] == 1 and figures["kill"]["at_fraction"] >= 0.5
    assert [rank["rank"] for rank in figures["survivors"]] == [0]
    assert figures["regrouped_after_kill_s"] is not None
    assert figures["store_bytes_over_model"] >= 1.0  # every byte came from the store once
    assert set(figures["goal"]) >= {"publish_met", "store_met"}
