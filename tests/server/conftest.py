"""Fixtures of the server tests: a started `dlo serve` is stopped, with every rank it started,
whatever the test did."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.server_helpers import PodFiles, RunningServer, pod_files, start_server


@pytest.fixture
def servers() -> Iterator[list[RunningServer]]:
    """Servers a test starts (append them); each is killed, process group and all, at the end."""
    started: list[RunningServer] = []
    yield started
    for server in started:
        server.kill_all()


@pytest.fixture(scope="module")
def one_rank_files(tmp_path_factory: pytest.TempPathFactory) -> PodFiles:
    return pod_files(tmp_path_factory.mktemp("pod"), ranks=1)


@pytest.fixture(scope="module")
def one_rank_server(one_rank_files: PodFiles, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[RunningServer]:
    """One rank, a queue of one image (a request for two cannot fit), ready."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    server = start_server(one_rank_files, log, "--queue-size", "1", "--max-n", "2")
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill_all()
