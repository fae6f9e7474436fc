"""What the operator shows a loader to read its fill summary: proof that it holds the DOD's fill
secret.

A loader answers `names.LOADER_SUMMARY_PATH` only to a request whose `names.LOADER_PROOF_HEADER`
is `summary_proof(secret)` for its own fill secret (`dlo_loader.fill_secret`); the operator
derives the same value from the DOD's fill Secret, which it reads through its API client. The
proof is an HMAC-SHA256 of a fixed label, so it reveals nothing of the secret nor of the keys
the fill group derives from it (`dlo_loader.group_keys`, `dlo_loader.peer_serve.access_key`:
other labels). Pure; imported by both planes.
"""

from __future__ import annotations

import hashlib
import hmac

_SUMMARY_LABEL = b"dlo loader: summary reader"


def summary_proof(secret: bytes) -> str:
    """The `LOADER_PROOF_HEADER` value that opens the summary of a loader keyed by `secret`."""
    return hmac.new(secret, _SUMMARY_LABEL, hashlib.sha256).hexdigest()


def proven(secret: bytes, shown: str) -> bool:
    """Whether `shown` (a request's header, as sent) is the proof for `secret`; compared in
    constant time."""
    return hmac.compare_digest(shown.encode("latin-1", "replace"),
                               summary_proof(secret).encode("ascii"))
