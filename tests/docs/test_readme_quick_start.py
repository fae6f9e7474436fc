"""The README's Kubernetes quick start, run command by command against the API emulator
(issue 35: it did not work as written). The commands are parsed out of the README
(`support.quick_start`), so the README and this test cannot drift; the sample `kubectl get dod
-w` output must be rows the DOD really shows, in the CRD's printer columns."""

from __future__ import annotations

import re
from typing import Any

import kopf
import pytest
import yaml
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    ClusterEmulator,
    cluster,  # noqa: F401  (the emulator fixture)
    eventually,
    live,
    operator_with,
    request,
)
from support.quick_start import (
    ROOT,
    live_dods,
    printer_row,
    quick_start,
    run_quick_start,
    sample_rows,
)

pytestmark = pytest.mark.slow  # the operator through a whole create, and the Helm engine


def the_readme() -> str:
    return (ROOT / "README.md").read_text()


OLD_QUICK_START = """## Kubernetes quick start

```sh
helm install dlo charts/dlo-operator --namespace dlo-system --create-namespace
kubectl label namespace dlo-system pod-security.kubernetes.io/enforce=privileged # node agent
kubectl label namespace inference pod-security.kubernetes.io/enforce=baseline   # see below
kubectl apply -f examples/flux-dp-allgather.yaml
kubectl get dod -n inference -w
# NAME       PHASE     READY   CACHE   AGE   MESSAGE
# flux-dev   Ready     2/2     2/2     3m    2/2 replicas ready
```
"""
"""The quick start as it was (issue 35): no image built, the namespace never created."""


async def test_the_quick_start_runs_as_written(cluster: ClusterEmulator) -> None:
    commands, sample = quick_start(the_readme())
    world = await run_quick_start(cluster, the_readme())
    assert [c[:2] for c in commands][-2:] == [["kubectl", "delete"], ["helm", "uninstall"]]
    assert not live_dods(world)  # none left behind with a finalizer nobody removes

    rows = sample_rows(sample)
    example = yaml.safe_load((ROOT / "examples" / "flux-dp-allgather.yaml").read_text())
    assert list(rows[0]) == [*printer_row(example), "AGE"]
    watched = world.watched
    print("\n".join(" | ".join(row.values()) for row in watched))
    for row in rows:
        shown = {key: value for key, value in row.items() if key != "AGE"}
        assert re.fullmatch(r"[0-9a-f]{10}", shown.pop("REVISION")), row
        assert shown in [{k: v for k, v in w.items() if k != "REVISION"} for w in watched], (
            row, watched)
    assert {**rows[-1], "REVISION": watched[-1]["REVISION"]} == {**watched[-1],
                                                                 "AGE": rows[-1]["AGE"]}


async def test_the_old_quick_start_fails_where_a_cluster_would(cluster: ClusterEmulator) -> None:
    with pytest.raises(AssertionError, match="the operator image dlo-operator:0.1.0"):
        await run_quick_start(cluster, OLD_QUICK_START)
    built = OLD_QUICK_START.replace("```sh\n", "```sh\n" + "\n".join(
        f"docker build -f {dockerfile} -t {image} .\ndocker push {image}" for dockerfile, image in
        (("operator/Dockerfile", "dlo-operator:0.1.0"),
         ("loader_image/Dockerfile", "dlo-loader:0.1.0"))) + "\n")
    with pytest.raises(AssertionError, match="namespace inference was never created"):
        await run_quick_start(cluster, built)


async def test_a_dod_deleted_after_the_operator_is_gone_stays(cluster: ClusterEmulator) -> None:
    """Why the quick start deletes the DODs before `helm uninstall`: the finalizer the operator
    put on the DOD is removed by the operator only."""
    document = yaml.safe_load((ROOT / "examples" / "flux-dp-allgather.yaml").read_text())
    name = document["metadata"]["name"]
    async with operator_with(kopf.Memo()):
        await request(cluster, "POST", DOD_PATH, document)
        await eventually(lambda: live(cluster, DOD_RESOURCE, name)["metadata"].get("finalizers"))
    await request(cluster, "DELETE", f"{DOD_PATH}/{name}")
    stuck = live(cluster, DOD_RESOURCE, name)
    assert stuck is not None and stuck["metadata"]["finalizers"]
