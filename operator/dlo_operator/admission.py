"""`admit`: the one verdict on a DiffusionOffloadDeployment, for the operator and `dlo render`.

In order: what the API server would refuse (`crd_verdict`: unknown fields, schema, CEL rules,
the name), then the settings validator (`spec.parse_spec`), then the installation's host-path
policy (`host_paths`). The first stage that refuses ends the check, and all its reasons go into
one `SpecError`, whose message the operator writes into `Valid=False` and an Event and `dlo
render` prints, word for word. Pure; it must not talk to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dlo_operator.crd_verdict import crd_refusals
from dlo_operator.errors import SpecError
from dlo_operator.host_paths import (
    DEFAULT_ALLOWED_HOST_PATHS,
    host_path_problems,
    host_paths_of,
    user_mount_paths,
)
from dlo_operator.naming import KIND
from dlo_operator.pod_rules import pod_problems
from dlo_operator.spec import DEFAULT_LOADER_IMAGE, DeploymentSpec, parse_spec

_JUDGED = ("apiVersion", "kind", "metadata", "spec")
"""What a user writes; the status is the operator's own and `kubectl apply` does not send it."""


def admit(document: Mapping[str, Any], *,
          allowed_host_paths: Sequence[str] = DEFAULT_ALLOWED_HOST_PATHS,
          loader_image: str = DEFAULT_LOADER_IMAGE) -> DeploymentSpec:
    """The typed spec of `document`, or `SpecError` naming every refused field.
    `allowed_host_paths` and `loader_image` are the installation's (the chart's values)."""
    judged = {key: _plain(document[key]) for key in _JUDGED if key in document}
    refusals = crd_refusals(judged)
    if refusals:
        raise SpecError("; ".join(refusals),
                        hint=f"fix the fields named; `kubectl explain {KIND.lower()}.spec` "
                        "describes each")
    spec = parse_spec(judged.get("spec"), default_loader_image=loader_image)
    problems = host_path_problems(host_paths_of(spec), allowed=allowed_host_paths,
                                  user_mounts=user_mount_paths(spec))
    problems += pod_problems(spec)
    if problems:
        raise SpecError("; ".join(problems))
    return spec


def _plain(value: Any) -> Any:
    """A deep plain copy of kopf's read-only views (the schema validator wants dicts/lists)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
