"""`dlo operator run`: run the DiffusionOffloadDeployment operator (kopf) until stopped.

Watches one or more namespaces (`--namespace`, repeatable; a namespaced Role suffices) or the
whole cluster (`--all-namespaces`, needs the ClusterRole). kopf serves the liveness endpoint.
Imports kopf and the Kubernetes client only when the command runs.
"""

from __future__ import annotations

import argparse

from dlo_operator.errors import OperatorError
from dlo_operator.render import add_installation_flags, allowed_host_paths

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NAMESPACE",
                       help="watch this namespace (repeat for several)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (cluster-wide RBAC)")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help="liveness endpoint served by the operator "
                        f"(default {DEFAULT_LIVENESS})")
    add_installation_flags(parser)


def run(args: argparse.Namespace) -> int:
    import kopf

    from dlo_operator.handlers import registry

    if not args.all_namespaces and not all(args.namespace):
        raise OperatorError("--namespace needs a namespace name",
                            hint="pass --namespace NAME or --all-namespaces")
    kopf.run(
        registry=registry,
        clusterwide=bool(args.all_namespaces),
        namespaces=list(args.namespace),
        standalone=True,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(allowed_host_paths=allowed_host_paths(args),
                       loader_image=args.loader_image),
    )
    return 0
