"""`dlo render FILE.yaml`: print the manifests the operator would create, without a cluster.

Reads one or more `DiffusionOffloadDeployment` documents and judges each as the cluster would
(`admission.admit`: the API server's schema and CEL rules, the settings validator, the
platform's choices, which take the same flags as `dlo operator run`), then prints its children
as a YAML stream. Owner references are left out: they need the DOD's uid, which only the cluster
assigns. A refused document fails with the message that `Valid=False` and the Event would carry
in the cluster.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from dlo_operator.admission import admit
from dlo_operator.errors import SpecError
from dlo_operator.installation import InstallationConfig, add_flags, from_args
from dlo_operator.manifests import build_children
from dlo_operator.naming import API_VERSION, KIND, Owner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="YAML file with DiffusionOffloadDeployment(s)")
    parser.add_argument("-n", "--namespace", default="default",
                        help="namespace for documents that name none (default: default)")
    add_flags(parser)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(render_file(args.file, namespace=args.namespace,
                                 installation=from_args(args)))
    return 0


def render_file(path: Path, *, namespace: str = "default",
                installation: InstallationConfig = InstallationConfig()) -> str:
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot read {path}: {exc}") from exc
    manifests = [m for doc in documents if doc is not None
                 for m in render_document(doc, namespace, installation)]
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the settings document) as literal blocks, readable in a review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render_document(document: Any, namespace: str,
                    installation: InstallationConfig = InstallationConfig(),
                    ) -> Iterable[dict[str, Any]]:
    if not isinstance(document, dict) or (document.get("apiVersion"), document.get("kind")) != (
            API_VERSION, KIND):
        found = document.get("kind") if isinstance(document, dict) else type(document).__name__
        raise SpecError(f"expected apiVersion {API_VERSION} kind {KIND}, found {found!r}")
    owner = Owner.from_body({**document, "metadata": {
        **(document.get("metadata") or {}), "uid": None}}, default_namespace=namespace)
    if not owner.name:
        raise SpecError(f"a {KIND} needs metadata.name")
    try:
        spec = admit(document, installation)
    except SpecError as exc:
        raise SpecError(f"{owner.namespace}/{owner.name}: {exc}", hint=exc.hint) from exc
    return build_children(owner, spec)
