"""Fixtures of the operator tests (defined in `operator_harness`)."""

from support.operator_harness import clock, cluster, operator  # noqa: F401  (pytest fixtures)
