"""`dlo operator run`: run the DiffusionOffloadDeployment operator (kopf) until stopped.

Watches one or more namespaces (`--namespace`, repeatable; a namespaced Role suffices) or the
whole cluster (`--all-namespaces`, needs the ClusterRole). kopf serves the liveness endpoint;
`--metrics-port` the Prometheus metrics (`dlo_operator.metrics`).
Imports kopf and the Kubernetes client only when the command runs.
"""

from __future__ import annotations

import argparse

from dlo_contract.names import OPERATOR_METRICS_PORT
from dlo_operator import installation
from dlo_operator.errors import OperatorError

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_METRICS_PORT = OPERATOR_METRICS_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NAMESPACE",
                       help="watch this namespace (repeat for several)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (cluster-wide RBAC)")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help="liveness endpoint served by the operator "
                        f"(default {DEFAULT_LIVENESS})")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, metavar="PORT",
                        help="serve Prometheus metrics at :PORT/metrics; 0 serves none "
                        f"(default {DEFAULT_METRICS_PORT})")
    installation.add_flags(parser)


def run(args: argparse.Namespace) -> int:
    import kopf

    from dlo_operator import metrics
    from dlo_operator.handlers import registry

    if not args.all_namespaces and not all(args.namespace):
        raise OperatorError("--namespace needs a namespace name",
                            hint="pass --namespace NAME or --all-namespaces")
    if not 0 <= args.metrics_port <= 65535:
        raise OperatorError(f"--metrics-port {args.metrics_port} is not a TCP port",
                            hint="pass a port from 1 to 65535, or 0 for no metrics")
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.run(
        registry=registry,
        clusterwide=bool(args.all_namespaces),
        namespaces=list(args.namespace),
        standalone=True,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(installation=installation.from_args(args)),
    )
    return 0
