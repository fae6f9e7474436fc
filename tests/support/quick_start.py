"""The README's Kubernetes quick start as a program: its commands parsed out of the README, each
run as the API calls it makes against the API emulator (`tests/docs/test_readme_quick_start.py`).

`quick_start` reads the first `sh` block under "Kubernetes quick start": comments dropped,
continued lines joined, `$VAR` expanded from its assignment; `# NAME ...` lines are the sample
output. `run_quick_start` runs them: `docker build`/`push` record the images (each Dockerfile must
exist), `helm install` renders the chart with the real Helm engine and starts the operator with
the rendered Deployment's arguments, each `kubectl` command makes its API calls (namespaces are
kept here: the emulator cannot serve `/api/v1/namespaces/NAME`). Each first checks what a real cluster
would need for it (the namespace exists, the image was pushed, the objects the DOD names exist,
the Pod Security labels), so a step left out fails. The cluster's controllers and kubelets are
`support.kube_standin`, the nodes labelled as GPU Feature Discovery would. A command this module
does not know fails: teach it the command's API calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import kmock
import kopf
import pytest
import yaml

from dlo_operator import cli as operator_cli
from dlo_operator.crd_verdict import load_crd
from dlo_operator.installation import from_args
from support.kube_standin import KubeStandIn
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    ClusterEmulator,
    dod_status,
    eventually,
    merge_patch,
    operator_with,
    request,
)

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the README, the chart, the examples, the Dockerfiles."""
MODEL_BYTES = 4096
GPU_LABEL = "nvidia.com/gpu.product"
ENFORCE = "pod-security.kubernetes.io/enforce"
CORE = "/api/v1"
RESOURCES = {
    "v1/serviceaccounts": ("ServiceAccount", True),
    "v1/secrets": ("Secret", True), "v1/nodes": ("Node", False),
    "scheduling.k8s.io/v1/priorityclasses": ("PriorityClass", False),
}
"""What the quick start creates beyond the operator's own kinds (the harness declares those).
Namespaces are kept by the test: the emulator cannot serve `/api/v1/namespaces/NAME` itself."""


def quick_start(readme: str) -> tuple[list[list[str]], list[str]]:
    """The commands of the quick start's `sh` block (comments dropped, continued lines joined,
    `$VAR` expanded from its assignment), and the sample output lines (`# NAME ...` on)."""
    section = readme.split("## Kubernetes quick start", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands: list[list[str]] = []
    sample: list[str] = []
    variables: dict[str, str] = {}
    for line in block.replace("\\\n", " ").splitlines():
        text = line.strip()
        if text.startswith("# NAME") or (sample and text.startswith("# ") and "/" in text):
            sample.append(text[2:])
            continue
        text = re.sub(r"\s+#\s.*$", "", text) if not text.startswith("#") else ""
        if not text:
            continue
        text = re.sub(r"\$([A-Z_]+)", lambda m: variables[m.group(1)], text)
        assignment = re.fullmatch(r"([A-Z_]+)=(\S+)", text)
        if assignment:
            variables[assignment.group(1)] = assignment.group(2)
            continue
        commands.append(shlex.split(text))
    return commands, sample


def printer_row(document: dict[str, Any]) -> dict[str, str]:
    """The DOD's row as `kubectl get` prints it: the CRD's printer columns of priority 0 (an
    absent value blank, as kubectl shows it), AGE left out (it moves)."""
    columns = load_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    row = {"NAME": document["metadata"]["name"]}
    for column in columns:
        if column.get("priority", 0) or column["name"] == "Age":
            continue
        value: Any = document
        for part in column["jsonPath"].lstrip(".").split("."):
            value = value.get(part) if isinstance(value, dict) else None
        row[column["name"].upper()] = "" if value is None else str(value)
    return row


def sample_rows(sample: list[str]) -> list[dict[str, str]]:
    """The sample output, cut at the header's column starts (kubectl's aligned columns)."""
    header = sample[0]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return [{name: line[start:end].strip() for name, start, end in
             zip(names, starts, [*starts[1:], None])} for line in sample[1:]]


@dataclass
class Cluster:
    """The quick start's world: what was built and pushed, the operator while installed, and
    the DOD's every status (replayed from the operator's status patches)."""

    emulator: ClusterEmulator
    standin: KubeStandIn
    built: set[str] = field(default_factory=set)
    pushed: set[str] = field(default_factory=set)
    operator: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    watched: list[dict[str, str]] = field(default_factory=list)
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    """Name -> labels."""
    agent_namespace: str = ""
    """Where the chart put the node agent (its DaemonSet), if it did."""

    def exists(self, resource: str, name: str, namespace: str | None = None) -> bool:
        key = (kmock.resource(resource), namespace, name)
        return key in self.emulator.objects and not self.emulator.objects[key].deleted

    def need_namespace(self, namespace: str) -> None:
        assert namespace in self.namespaces, f"namespace {namespace} was never created"

    async def create(self, path: str, body: dict[str, Any]) -> None:
        await request(self.emulator, "POST", path, body)


async def docker(world: Cluster, args: list[str]) -> None:
    if args[0] == "build":
        options = parse(args[1:], "-f", "-t")
        dockerfile = options["-f"]
        assert (ROOT / dockerfile).is_file(), dockerfile
        assert options["_"] == ["."], "build from the repository root"
        world.built.add(options["-t"])
    elif args[0] == "push":
        assert args[1] in world.built, f"{args[1]} pushed before it was built"
        world.pushed.add(args[1])
    else:
        raise AssertionError(f"docker {args[0]}: unknown to the test")


async def helm_command(world: Cluster, args: list[str]) -> None:
    if args[0] == "uninstall":
        await world.operator.aclose()
        return
    assert args[0] == "install", f"helm {args[0]}: unknown to the test"
    options = parse(args[1:], "--namespace", "--set", repeat=("--set",))
    release, chart = options["_"]
    if "--create-namespace" in args:
        world.namespaces.setdefault(options["--namespace"], {})
    world.need_namespace(options["--namespace"])
    values: dict[str, Any] = {}
    for setting in options.get("--set", []):
        key, value = setting.split("=", 1)
        *parents, leaf = key.split(".")
        target = values
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    with helm.Chart.load(ROOT / chart) as loaded:
        rendered = loaded.render(values, name=release, namespace=options["--namespace"],
                                 is_install=True)
    docs = [doc for name, text in rendered.items() if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] in world.pushed, f"the operator image {container['image']}"
    if any(doc["kind"] == "DaemonSet" for doc in docs):
        world.agent_namespace = options["--namespace"]
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    installation = from_args(parser.parse_args(container["args"][2:]))
    assert installation.loader_image in world.pushed, installation.loader_image
    await world.operator.enter_async_context(operator_with(kopf.Memo(installation=installation)))


async def kubectl(world: Cluster, args: list[str]) -> None:
    options = parse(args[1:], "-f", "-n", "-l", "--for", "--timeout", "--value",
                    "--docker-server", "--docker-username", "--docker-password")
    verb, (kind, *positional) = args[0], options["_"] or [""]
    options["_"] = positional
    if options.get("-n"):
        world.need_namespace(options["-n"])
    handler = KUBECTL.get((verb, kind)) or KUBECTL.get((verb, ""))
    assert handler is not None, f"kubectl {verb} {kind}: unknown to the test"
    await handler(world, kind, options)


async def create_namespace(world: Cluster, _: str, options: dict[str, Any]) -> None:
    name = options["_"][0]
    assert name not in world.namespaces, f"namespace {name} exists already"
    world.namespaces[name] = {}


async def label_namespace(world: Cluster, _: str, options: dict[str, Any]) -> None:
    name, *labels = options["_"]
    world.need_namespace(name)
    world.namespaces[name].update(label.split("=", 1) for label in labels)


async def create_serviceaccount(world: Cluster, _: str, options: dict[str, Any]) -> None:
    await world.create(f"{CORE}/namespaces/{options['-n']}/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": options["_"][0]}})


async def create_secret(world: Cluster, _: str, options: dict[str, Any]) -> None:
    kind, name = options["_"]
    assert kind == "docker-registry" and options["--docker-server"], options
    await world.create(f"{CORE}/namespaces/{options['-n']}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
        "metadata": {"name": name}, "data": {".dockerconfigjson": "e30="}})


async def create_priorityclass(world: Cluster, _: str, options: dict[str, Any]) -> None:
    await world.create("/apis/scheduling.k8s.io/v1/priorityclasses", {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": options["_"][0]}, "value": int(options["--value"])})


async def get_nodes(world: Cluster, _: str, options: dict[str, Any]) -> None:
    key, value = options["-l"].split("=", 1)
    found = [r.raw for k, r in world.emulator.objects.items()
             if k[0] == kmock.resource("v1/nodes") and not r.deleted
             and r.raw["metadata"].get("labels", {}).get(key) == value]
    assert len(found) >= 2, f"nodes labelled {options['-l']}: {found}"


async def apply_file(world: Cluster, _: str, options: dict[str, Any]) -> None:
    """`kubectl apply -f`: the DOD, once everything it names exists (a pod naming a missing
    service account, PriorityClass or image is never created)."""
    document = yaml.safe_load((ROOT / options["-f"]).read_text())
    namespace, spec = document["metadata"]["namespace"], document["spec"]
    world.need_namespace(namespace)
    assert world.namespaces[namespace].get(ENFORCE) == "baseline", world.namespaces[namespace]
    if world.agent_namespace:  # the node agent mounts a node directory: no pod of it before
        assert world.namespaces[world.agent_namespace].get(ENFORCE) == "privileged"
    assert world.exists("v1/serviceaccounts", spec["serviceAccountName"], namespace)
    for secret in spec.get("imagePullSecrets", ()):
        assert world.exists("v1/secrets", secret["name"], namespace), secret
    assert world.exists("scheduling.k8s.io/v1/priorityclasses", spec["priorityClassName"])
    assert spec["inference"]["image"] in world.pushed, spec["inference"]["image"]
    await request(world.emulator, "POST", DOD_PATH, document)


async def get_dod(world: Cluster, _: str, options: dict[str, Any]) -> None:
    """`kubectl get dod -w`: every row the DOD shows until it is Ready."""
    assert "-w" in options["flags"]
    name = next(iter(live_dods(world)))
    await eventually(lambda: dod_status(world.emulator, name).get("phase") == "Ready",
                     timeout=60.0)
    world.watched = status_rows(world, name)


async def wait_condition(world: Cluster, target: str, options: dict[str, Any]) -> None:
    condition = options["--for"].removeprefix("condition=")
    name = target.removeprefix("dod/")
    await eventually(lambda: any(c["type"] == condition and c["status"] == "True" for c in
                                 dod_status(world.emulator, name).get("conditions", ())))


async def delete_dods(world: Cluster, _: str, options: dict[str, Any]) -> None:
    assert options["flags"] == ["--all"], options
    for name in live_dods(world):
        await request(world.emulator, "DELETE", f"{DOD_PATH}/{name}")
    await eventually(lambda: not live_dods(world), timeout=30.0)


KUBECTL = {("create", "namespace"): create_namespace, ("label", "namespace"): label_namespace,
           ("create", "serviceaccount"): create_serviceaccount,
           ("create", "secret"): create_secret, ("create", "priorityclass"): create_priorityclass,
           ("get", "nodes"): get_nodes, ("apply", ""): apply_file, ("get", "dod"): get_dod,
           ("wait", ""): wait_condition, ("delete", "dod"): delete_dods}


def parse(args: list[str], *valued: str, repeat: tuple[str, ...] = ()) -> dict[str, Any]:
    """Options of a command: `--x=v` or `--x v` for `valued`, other `-`flags listed under
    "flags", positional arguments under "_"."""
    out: dict[str, Any] = {"_": [], "flags": []}
    items = iter(args)
    for item in items:
        key, _, inline = item.partition("=")
        if key in valued:
            value = inline if "=" in item else next(items)
            if key in repeat:
                out.setdefault(key, []).append(value)
            else:
                out[key] = value
        elif item.startswith("-"):
            out["flags"].append(item)
        else:
            out["_"].append(item)
    return out


def live_dods(world: Cluster) -> list[str]:
    return [k[2] for k, r in world.emulator.objects.items()
            if k[0] == kmock.resource(DOD_RESOURCE) and not r.deleted]


def status_rows(world: Cluster, name: str) -> list[dict[str, str]]:
    """Every row `kubectl get -w` shows: the DOD after each of the operator's status patches,
    replayed in order (merge patches), so no state is missed however fast it passed."""
    document = {"metadata": {"name": name}, "status": {}}
    rows = []
    for r in list(world.emulator):
        if (r.resource == kmock.resource(DOD_RESOURCE) and r.subresource == "status"
                and r.name == name and r.method == "PATCH" and isinstance(r.data, dict)):
            document["status"] = merge_patch(document["status"], r.data.get("status") or {})
            row = printer_row(document)
            if not rows or rows[-1] != row:
                rows.append(row)
    return rows


async def run_quick_start(cluster: ClusterEmulator, readme: str) -> Cluster:
    """Run the quick start of `readme`; returns its world once every command ran."""
    commands, _ = quick_start(readme)
    for resource, (kind, namespaced) in RESOURCES.items():
        cluster.resources[resource] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "patch", "delete"})
    example = yaml.safe_load((ROOT / "examples" / "flux-dp-allgather.yaml").read_text())
    nodes = [f"gpu-{i}" for i in range(example["spec"]["replicas"])]
    for node in nodes:  # labelled as NVIDIA GPU Feature Discovery labels them
        if (kmock.resource("v1/nodes"), None, node) in cluster.objects:
            continue
        await request(cluster, "POST", f"{CORE}/nodes", {"apiVersion": "v1", "kind": "Node",
                      "metadata": {"name": node, "labels": {
                          GPU_LABEL: example["spec"]["nodeSelector"][GPU_LABEL]}}})
    standin = KubeStandIn(cluster, nodes=nodes,
                          store={example["spec"]["model"]["source"]: MODEL_BYTES})
    world = Cluster(cluster, standin)
    task = asyncio.create_task(standin.run())
    programs = {"docker": docker, "helm": helm_command, "kubectl": kubectl}
    try:
        async with world.operator:
            for command in commands:
                assert command[0] in programs, f"{command}: unknown to the test"
                await programs[command[0]](world, command[1:])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return world
