"""The DOD's fill Secret: random bytes that only its loaders hold, which key its fill group.

Every store key, member record and peer-serving key of the DOD's fill groups is derived from
these bytes (`dlo_loader.fill_secret` reads them), so a process that lacks them cannot join,
read from, break or redirect the group. The Secret is mounted read-only in the loader containers
only (the workload pods' sidecar and the prefill Job's loaders, `pod.loader_container`), never
in the inference container.

`build_fill_secret` is the Secret without its data: what `dlo render` prints, and what the
reconciler compares with the live Secret's metadata (labels, owner reference). `new_data` is 32
fresh random bytes from `secrets`, hex-encoded, and makes the Secret immutable; the reconciler
writes it only into a Secret that has none (it creates the Secret with it, or fills one applied
from a render), so the data is written once and never again: a reconcile or a spec change never
rotates it (that would split running loaders between two keys). A Secret someone deleted is
created again with new bytes; a group that started with the old ones cannot meet the new members,
follows `loader.onRendezvousTimeout`, and fills again. No cluster access (`reconcile` writes);
called by `reconcile` and `manifests`.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from dlo_contract.names import FILL_SECRET_KEY
from dlo_operator.naming import LABEL_ROLE, Owner, child_metadata

SECRET_BYTES = 32
"""Random bytes per DOD; hex-encoded in the Secret, so the file holds 64 ASCII characters (no
whitespace for the loader's reader to strip)."""
SECRET_ROLE = "fill-secret"
"""`LABEL_ROLE` of the fill Secret."""


def build_fill_secret(owner: Owner) -> dict[str, Any]:
    """The DOD's fill Secret, owned by the DOD, without data (`new_data` holds it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(owner, owner.fill_secret_name, **{LABEL_ROLE: SECRET_ROLE}),
        "type": "Opaque",
    }


def new_data() -> dict[str, Any]:
    """Fresh random data under `FILL_SECRET_KEY`, made immutable with it: what the reconciler
    writes into a fill Secret that has none, once."""
    value = secrets.token_hex(SECRET_BYTES).encode("ascii")
    return {"data": {FILL_SECRET_KEY: base64.b64encode(value).decode("ascii")},
            "immutable": True}
