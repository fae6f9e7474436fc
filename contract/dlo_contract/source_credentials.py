"""The schemes of `model.source` and the environment each scheme's credentials arrive in.

Owns the name of every credential variable a loader reads and the path of the one credential
that arrives as a file (a GCS service-account key). The operator writes these into the loader
container from the DOD's Secret reference (`model.credentials`, as `secretKeyRef` entries and a
read-only Secret volume, never as values); the loader's readers read them, each from its own
scheme's names only. Without a Secret the readers fall back to the pod's workload identity (the
service account of `serviceAccountName`) through the official clients' default chains.

Every name is the one the official client of the scheme reads already (boto3, google-auth,
huggingface_hub), except where the client has none (`AZURE_STORAGE_*` follow the Azure CLI's
names, `DLO_HTTPS_TOKEN` is this project's). Pure constants and records; must not read the
environment.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Scheme(enum.Enum):
    """A kind of source, by the URI scheme of `model.source` (an Azure Blob URL written as
    `https://<account>.blob.core.windows.net/...` is `AZ`; see `dlo_contract.source_uri`)."""

    S3 = "s3"
    FILE = "file"
    GS = "gs"
    AZ = "az"
    HTTPS = "https"
    HF = "hf"


# --- S3 (boto3's own names) ---------------------------------------------------------------------
AWS_ACCESS_KEY_ID_ENV = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ACCESS_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
AWS_SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"

# --- Google Cloud Storage (google-auth's own name) ---------------------------------------------
GOOGLE_APPLICATION_CREDENTIALS_ENV = "GOOGLE_APPLICATION_CREDENTIALS"
"""Path of a service-account key file (JSON); the operator points it at `GCS_KEY_FILE`."""
SOURCE_CREDENTIALS_MOUNT = "/var/run/secrets/dlo/source"
"""Where the operator mounts the Secret's key file, read-only, in the loader."""
GCS_KEY_FILE = f"{SOURCE_CREDENTIALS_MOUNT}/key.json"

# --- Azure Blob (the Azure CLI's names; the SDK reads none itself) -----------------------------
AZURE_CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
"""A whole connection string (account, key or SAS, endpoints); it wins over the two below."""
AZURE_ACCOUNT_KEY_ENV = "AZURE_STORAGE_KEY"
"""The shared key of the account named in the source URI."""
AZURE_SAS_TOKEN_ENV = "AZURE_STORAGE_SAS_TOKEN"
"""A shared access signature for the container."""

# --- HTTP(S) listing-file servers and the Hugging Face Hub -------------------------------------
HTTPS_TOKEN_ENV = "DLO_HTTPS_TOKEN"
"""A bearer token sent as `Authorization: Bearer` with every request of an `https://` source."""
HF_TOKEN_ENV = "HF_TOKEN"
"""A Hugging Face access token (huggingface_hub's own name), for gated and private repos."""


@dataclass(frozen=True)
class SchemeCredentials:
    """What a scheme's loader reads: `env`, the variables (each optional: the reader uses those
    present, else its client's default chain), and `key_file`, a file the operator mounts from
    the Secret (None for schemes without one)."""

    scheme: Scheme
    env: tuple[str, ...]
    key_file: str | None = None


SCHEME_CREDENTIALS: dict[Scheme, SchemeCredentials] = {
    c.scheme: c for c in (
        SchemeCredentials(Scheme.S3, (AWS_ACCESS_KEY_ID_ENV, AWS_SECRET_ACCESS_KEY_ENV,
                                      AWS_SESSION_TOKEN_ENV)),
        SchemeCredentials(Scheme.FILE, ()),
        SchemeCredentials(Scheme.GS, (GOOGLE_APPLICATION_CREDENTIALS_ENV,), GCS_KEY_FILE),
        SchemeCredentials(Scheme.AZ, (AZURE_CONNECTION_STRING_ENV, AZURE_ACCOUNT_KEY_ENV,
                                      AZURE_SAS_TOKEN_ENV)),
        SchemeCredentials(Scheme.HTTPS, (HTTPS_TOKEN_ENV,)),
        SchemeCredentials(Scheme.HF, (HF_TOKEN_ENV,)),
    )
}
"""Each scheme's credential variables; a reader must read no other scheme's."""

CREDENTIAL_ENV = frozenset(name for c in SCHEME_CREDENTIALS.values() for name in c.env)
"""Every credential variable: values a loader must never log, report or put in an error."""
