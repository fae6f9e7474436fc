"""Fixtures of the operator tests (defined in `operator_harness`)."""

from operator_harness import cluster, operator  # noqa: F401  (pytest fixtures)
