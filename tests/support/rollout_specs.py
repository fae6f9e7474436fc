"""The model change the operator's rollout tests make: a DOD of two replicas on two GPU nodes
whose source moves from `V1` to `V2`, what the store holds under each, and the tests' now."""

from __future__ import annotations

import datetime

from dlo_operator.naming import Owner
from dlo_operator.spec import parse_spec

V1, V2 = "s3://models/flux-v1/", "s3://models/flux-v2/"
STORE = {V1: 1000, V2: 1200}
"""Bytes under each source in the emulated store."""
OWNER = Owner(name="flux", namespace="ml", uid="uid-1")
OLD = parse_spec({"model": {"source": V1}, "inference": {"image": "s:1"}, "replicas": 2})
NEW = parse_spec({"model": {"source": V2}, "inference": {"image": "s:1"}, "replicas": 2})
NOW = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=datetime.timezone.utc)
NODES = ("gpu-0", "gpu-1")
