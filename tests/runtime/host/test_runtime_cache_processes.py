"""Three real serving processes share one runtime entry; a damaged entry sends each back to its
ordinary tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import support
from test_runtime_weight_cache import corrupt_last_byte

from dlo_contract.cache import list_entries

WORKER = Path(support.__file__).with_name("runtime_cache_worker.py")
PROCESSES = 3


def start_processes(root: Path) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return [subprocess.Popen([sys.executable, str(WORKER), str(root)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for _ in range(PROCESSES)]


def next_reports(procs: list[subprocess.Popen[str]]) -> list[dict]:
    reports = []
    for proc in procs:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        reports.append(json.loads(line))
    return reports


@pytest.mark.slow
def test_three_processes_publish_one_entry_and_all_map_it(tmp_path: Path) -> None:
    procs = start_processes(tmp_path)
    try:
        reports = next_reports(procs)
        entry_ids = {r["entry_id"] for r in reports}
        assert len(entry_ids) == 1
        assert [e.entry_id for e in list_entries(tmp_path)] == list(entry_ids)
        assert sorted(r["published"] for r in reports) == [False, False, True]
        assert all(r["reason"] is None and r["equal"] and r["mapped"] for r in reports)

        corrupt_last_byte(tmp_path, entry_ids.pop())
        for proc in procs:
            proc.stdin.write("again\n")
            proc.stdin.flush()
        damaged = next_reports(procs)
        assert [r["reason"] for r in damaged] == [
            f"runtime cache entry {r['entry_id']} does not hold this process's tensors (content "
            "digest mismatch after mapping)" for r in reports]
        assert not any(r["published"] or r["mapped"] for r in damaged)
        for proc in procs:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
