"""`dlo operator run`: the watch scope and the liveness endpoint reach kopf."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from dlo_operator import handlers, metrics
from dlo_operator.installation import InstallationConfig
from dlo_cli import main as cli


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    ports: list[int] = []
    monkeypatch.setattr(metrics, "serve", lambda port: ports.append(port) or port)
    return ports


@pytest.fixture()
def kopf_runs(monkeypatch: pytest.MonkeyPatch, served: list[int]) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    return calls


def test_metrics_are_served_on_the_metrics_port(kopf_runs: list[dict[str, Any]],
                                                served: list[int]) -> None:
    assert cli.main(["operator", "run", "-A", "--metrics-port", "9191"]) == 0
    assert cli.main(["operator", "run", "-A"]) == 0
    assert cli.main(["operator", "run", "-A", "--metrics-port", "0"]) == 0
    assert served == [9191, 8081]
    assert cli.main(["operator", "run", "-A", "--metrics-port", "70000"]) == 1


def test_namespaces_are_watched_one_by_one(kopf_runs: list[dict[str, Any]]) -> None:
    assert cli.main(["operator", "run", "-n", "a", "--namespace", "b",
                     "--liveness", "http://0.0.0.0:9000/healthz"]) == 0
    assert kopf_runs == [{"registry": handlers.registry, "clusterwide": False,
                          "namespaces": ["a", "b"], "standalone": True,
                          "liveness_endpoint": "http://0.0.0.0:9000/healthz",
                          "memo": kopf.Memo(installation=InstallationConfig())}]


def test_the_installation_choices_reach_the_handlers(kopf_runs: list[dict[str, Any]]) -> None:
    assert cli.main(["operator", "run", "-A", "--allowed-host-path", "/mnt/nvme",
                     "--allowed-host-path=/var/lib/dlo", "--loader-image=reg/dlo-loader:2",
                     "--allowed-loader-image=reg/dlo-loader:3", "--allowed-user-host-path=/data",
                     "--node-cache-max-bytes=1000", "--node-cache-min-free-bytes", "10"]) == 0
    assert kopf_runs[0]["memo"] == kopf.Memo(installation=InstallationConfig(
        allowed_host_paths=("/mnt/nvme", "/var/lib/dlo"), loader_image="reg/dlo-loader:2",
        allowed_loader_images=("reg/dlo-loader:3",), allowed_user_host_paths=("/data",),
        node_cache_max_bytes=1000, node_cache_min_free_bytes=10))


def test_a_node_cache_limit_must_be_a_byte_count(kopf_runs: list[dict[str, Any]],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["operator", "run", "-A", "--node-cache-max-bytes=10GiB"])
    assert "'10GiB' is not a byte count; pass a whole number of bytes, 0 or more" in (
        capsys.readouterr().err)
    assert kopf_runs == []


def test_all_namespaces(kopf_runs: list[dict[str, Any]]) -> None:
    assert cli.main(["operator", "run", "--all-namespaces"]) == 0
    assert (kopf_runs[0]["clusterwide"], kopf_runs[0]["namespaces"],
            kopf_runs[0]["liveness_endpoint"]) == (True, [], "http://0.0.0.0:8080/healthz")


def test_a_scope_is_required(kopf_runs: list[dict[str, Any]],
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["operator", "run"])
    assert info.value.code == 2
    assert "one of the arguments -n/--namespace -A/--all-namespaces is required" in (
        capsys.readouterr().err)
    assert cli.main(["operator", "run", "--namespace", ""]) == 1
    assert capsys.readouterr().err == ("dlo: error: --namespace needs a namespace name "
                                       "(hint: pass --namespace NAME or --all-namespaces)\n")
    assert kopf_runs == []
