"""The DOD's fill secret, as a loader reads it: the bytes every fill-group key is derived from.

The operator creates one random Secret per DOD and mounts it in that DOD's loaders only; the path
comes in `DLO_FILL_SECRET_FILE` (`dlo_contract.names`). A loader started by hand has none, and its
group is then as open as torch.distributed's own store: the CLI says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlo_contract.names import FILL_SECRET_ENV

from .errors import LoaderError

MIN_SECRET_BYTES = 16
"""Fewer bytes than this are too few to keep a stranger from guessing them."""


def read_fill_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The secret named by `DLO_FILL_SECRET_FILE`, or None when the variable is unset.

    A variable that names a missing, unreadable or too short file is a `LoaderError` naming the
    variable and the path (never the bytes): a pod the operator made always has the file, so a
    missing one is a broken mount, not a reason to run an open group.
    """
    env = os.environ if environ is None else environ
    path = env.get(FILL_SECRET_ENV, "")
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise LoaderError(f"environment variable {FILL_SECRET_ENV}={path!r}: cannot read the fill "
                          f"secret ({exc.strerror or exc}); the operator mounts the DOD's fill "
                          f"Secret there") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise LoaderError(f"environment variable {FILL_SECRET_ENV}={path!r}: the fill secret has "
                          f"{len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; recreate the DOD's "
                          f"fill Secret (the operator writes 32 random bytes)")
    return secret
