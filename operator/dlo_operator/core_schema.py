"""The Kubernetes schema of each core/v1 object a DOD passes through to its children.

The CRD keeps these fields (`spec.tolerations`, `spec.inference.env`, the probes, ...) as
free-form objects, so `kubectl apply` of a DOD accepts what the API server later refuses in the
StatefulSet. `core_schema_problems` checks each one against its core/v1 definition, from the
strict JSON schemas `kubernetes-validate` ships (unknown fields, types, required fields) for the
newest Kubernetes it knows, so that only what no supported cluster accepts is refused. Each
refusal names the field as the user wrote it in the DOD (`spec.tolerations[0].operator`), never
the child's path. What the schemas cannot say (label syntax, quantities, one probe handler, ...)
is `core_rules`'. Called by `admission`; pure, no cluster.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
from kubernetes_validate.utils import latest_version

from dlo_operator.spec import DeploymentSpec, field_name


@dataclass(frozen=True)
class CoreField:
    """One DOD field holding core/v1 objects: its `DeploymentSpec` path, the definition each
    object must match, and whether the field is a list of them."""

    path: str
    definition: str
    many: bool = False

    @property
    def name(self) -> str:
        """The field as the user wrote it (`spec.inference.volumeMounts`)."""
        return field_name(self.path)

    def items(self, spec: DeploymentSpec) -> Iterator[tuple[str, Any]]:
        """(name, object) of each object the user set; an empty probe or affinity is none."""
        value: Any = spec
        for part in self.path.split("."):
            value = getattr(value, part)
        if self.many:
            yield from ((f"{self.name}[{index}]", item) for index, item in enumerate(value))
        elif value:
            yield self.name, value


CORE_FIELDS: tuple[CoreField, ...] = (
    CoreField("inference.env", "io.k8s.api.core.v1.EnvVar", many=True),
    CoreField("inference.resources", "io.k8s.api.core.v1.ResourceRequirements"),
    CoreField("inference.ports", "io.k8s.api.core.v1.ContainerPort", many=True),
    CoreField("inference.readiness_probe", "io.k8s.api.core.v1.Probe"),
    CoreField("inference.startup_probe", "io.k8s.api.core.v1.Probe"),
    CoreField("inference.liveness_probe", "io.k8s.api.core.v1.Probe"),
    CoreField("inference.volume_mounts", "io.k8s.api.core.v1.VolumeMount", many=True),
    CoreField("loader.resources", "io.k8s.api.core.v1.ResourceRequirements"),
    CoreField("tolerations", "io.k8s.api.core.v1.Toleration", many=True),
    CoreField("affinity", "io.k8s.api.core.v1.Affinity"),
    CoreField("image_pull_secrets", "io.k8s.api.core.v1.LocalObjectReference", many=True),
    CoreField("volumes", "io.k8s.api.core.v1.Volume", many=True),
)
"""Every DOD field whose description says it holds core/v1 objects (a test checks the list)."""


def core_schema_problems(spec: DeploymentSpec) -> list[str]:
    """One message per schema violation of a core/v1 object in `spec`, naming the DOD field."""
    problems = []
    for field in CORE_FIELDS:
        validator = _validator(field.definition)
        for name, value in field.items(spec):
            for error in sorted(validator.iter_errors(value), key=lambda e: list(e.path)):
                problems.append(f"{_path(name, error.absolute_path)}: {error.message} "
                                f"(core/v1 {field.definition.rsplit('.', 1)[-1]}, as the API "
                                "server checks it)")
    return problems


@functools.cache
def _definitions() -> dict[str, Any]:
    """The strict core definitions of the newest Kubernetes version `kubernetes-validate` ships."""
    folder = f"kubernetes-json-schema/v{latest_version()}-local-strict"
    text = importlib.resources.files("kubernetes_validate").joinpath(
        folder, "_definitions.json").read_text()
    return json.loads(text)["$defs"]


@functools.cache
def _validator(definition: str) -> jsonschema.Draft202012Validator:
    schema = {"$defs": _definitions(), "$ref": f"#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(schema)


def _path(name: str, path: Any) -> str:
    return name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)
