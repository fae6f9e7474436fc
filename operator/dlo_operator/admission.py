"""`admit`: the one verdict on a DiffusionOffloadDeployment, for the operator and `dlo render`.

In order: what the API server would refuse (`crd_verdict`: unknown fields, schema, CEL rules,
the name), then the settings validator (`spec.parse_spec`), then what the API server would
refuse of the core/v1 objects the DOD passes to its children (`core_rules`: their Kubernetes
schema, labels, names, quantities, probes, mounts), then the platform's choices
(`installation.InstallationConfig`, the chart's values): the host-path allowlist of the DOD's own
volumes and the cache paths' prefix (`host_paths`), the loader images and the node cache's limits
(`platform_limits`), with the pod rules (`pod_rules`). The first stage that refuses ends the
check, and all its reasons go into one `SpecError`, whose message the operator writes into
`Valid=False` and an Event and `dlo render` prints, word for word. An admitted spec carries the
node cache's effective limits in its settings and the loader's user and group (`loader`). Pure;
it must not talk to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlo_operator.core_rules import core_problems
from dlo_operator.crd_verdict import crd_refusals
from dlo_operator.errors import SpecError
from dlo_operator.host_paths import cache_path_problems, user_volume_problems
from dlo_operator.installation import InstallationConfig
from dlo_operator.loader_image import annotation_problems
from dlo_operator.naming import KIND
from dlo_operator.platform_limits import (
    cache_limit_problems,
    loader_image_problems,
    with_platform_limits,
)
from dlo_operator.pod_rules import pod_problems
from dlo_operator.spec import DeploymentSpec, parse_spec

_JUDGED = ("apiVersion", "kind", "metadata", "spec")
"""What a user writes; the status is the operator's own and `kubectl apply` does not send it."""


def admit(document: Mapping[str, Any],
          installation: InstallationConfig = InstallationConfig()) -> DeploymentSpec:
    """The typed spec of `document`, with the node cache's effective limits in its settings,
    or `SpecError` naming every refused field. `installation` holds the chart's values."""
    judged = {key: _plain(document[key]) for key in _JUDGED if key in document}
    refusals = crd_refusals(judged)
    if refusals:
        raise SpecError("; ".join(refusals),
                        hint=f"fix the fields named; `kubectl explain {KIND.lower()}.spec` "
                        "describes each")
    spec = parse_spec(judged.get("spec"), default_loader_image=installation.loader_image)
    refused = core_problems(spec)
    if refused:
        raise SpecError("; ".join(refused), hint="the API server would refuse these in the "
                        "DOD's StatefulSet; fix the fields named")
    problems = user_volume_problems(spec.volumes, allowed=installation.allowed_user_host_paths,
                                    cache_roots=installation.cache_directories)
    problems += cache_path_problems(spec, installation.cache_path_prefix)
    problems += loader_image_problems(spec, installation)
    problems += cache_limit_problems(spec.settings, installation)
    problems += pod_problems(spec)
    problems += annotation_problems(judged)
    if problems:
        raise SpecError("; ".join(problems))
    loader = spec.loader.model_copy(update={"run_as_user": installation.node_cache_uid,
                                            "run_as_group": installation.node_cache_gid})
    return spec.model_copy(update={"settings": with_platform_limits(spec.settings, installation),
                                   "loader": loader,
                                   "network_policy": installation.network_policy})


def _plain(value: Any) -> Any:
    """A deep plain copy of kopf's read-only views (the schema validator wants dicts/lists)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
