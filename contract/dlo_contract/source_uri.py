"""`model.source` (document path `loader.source`): which URIs are sources, and what they name.

Owns the one spelling of each scheme's URI: `SOURCE_PATTERN` (the CRD's `pattern` of the field,
declared in `dlo_contract.settings`) and `parse_source_uri`, which splits a URI into a
`SourceAddress` or raises a `SettingsError` that names the field as the user wrote it, the value
and the forms allowed. The validator (`dlo_contract.validation`), the operator (which mounts a
`file://` share) and the loader's readers call it; none splits a URI by hand. Standard library
only; must not touch the network or the file system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlo_contract.field_names import Names, document_names
from dlo_contract.schema import SettingsError
from dlo_contract.source_credentials import Scheme

_SEGMENT = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
"""A path segment that is not `.` or `..` (RE2 has no lookahead: the CRD's regex engine)."""
AZURE_BLOB_HOST = ".blob.core.windows.net"
"""An `https://` source on `<account>` + this host is an Azure Blob container."""

SCHEME_PATTERNS: dict[Scheme, str] = {
    Scheme.S3: r"s3://[^/?#]+/[^?#]*",
    Scheme.FILE: rf"file://(/{_SEGMENT})+/?",
    Scheme.GS: r"gs://[^/?#]+/[^?#]*",
    Scheme.AZ: r"az://[a-z0-9]+/[^/?#]+(/[^?#]*)?",
    Scheme.HTTPS: r"https?://[^/@?#]+/[^?#]*",
    Scheme.HF: r"hf://[^/@?#]+/[^/@?#]+(@[^/?#]+)?(/[^?#]*)?",
}
"""Each scheme's URIs (an Azure Blob `https://` URL matches `HTTPS`'s). None holds a query, a
fragment or a `user:password@`: a URI is written into the settings document, the status and
messages, so a SAS token or a password in it would be too (credentials go in a Secret)."""
_CREDENTIAL_PARTS = re.compile(r"[?#]|^[a-z0-9]+://[^/]*@")
"""A query, a fragment, or user information before the host."""
SOURCE_PATTERN = "^(" + "|".join(SCHEME_PATTERNS.values()) + ")$"
"""The CRD's pattern of `model.source`: any scheme's URI."""
ENDPOINT_PATTERN = r"^https?://[^/@?#]+(/[^?#]*)?$"
"""`model.endpointUrl`: an http(s) URL without credentials in it (checked by the validator,
whose refusal hides what the URL carries; the CRD's generic pattern message would repeat it)."""

SCHEME_FORMS: dict[Scheme, str] = {
    Scheme.S3: "s3://bucket/prefix/",
    Scheme.FILE: "file:///path/ (absolute, without '.', '..' or '//')",
    Scheme.GS: "gs://bucket/prefix/",
    Scheme.AZ: "az://account/container/prefix/ or "
    "https://account.blob.core.windows.net/container/prefix/ (account in lower case)",
    Scheme.HTTPS: "https://host/path/",
    Scheme.HF: "hf://org/repo[@revision]/",
}
"""Each scheme's forms, as errors and the README name them."""


@dataclass(frozen=True)
class SourceAddress:
    """A parsed source. `container` is the bucket (s3, gs), the container (az), the host and
    port (https) or `org/repo` (hf), empty for file; `prefix` is empty or ends with `/` (for
    file, the absolute directory path with its leading and trailing `/`)."""

    scheme: Scheme
    container: str
    prefix: str
    account: str = ""
    """The storage account (az only)."""
    revision: str = ""
    """The branch, tag or commit after `@` (hf only); empty means the repo's default branch."""
    secure: bool = True
    """False for an `http://` source (https only)."""

    def __str__(self) -> str:
        """The canonical URI: equal for equal sources, so it keys entries and names errors."""
        if self.scheme is Scheme.FILE:
            return f"file://{self.prefix}"
        if self.scheme is Scheme.AZ:
            return f"az://{self.account}/{self.container}/{self.prefix}"
        if self.scheme is Scheme.HTTPS:
            return f"{'https' if self.secure else 'http'}://{self.container}/{self.prefix}"
        if self.scheme is Scheme.HF:
            at = f"@{self.revision}" if self.revision else ""
            return f"hf://{self.container}{at}/{self.prefix}"
        return f"{self.scheme.value}://{self.container}/{self.prefix}"


def _prefix(path: str) -> str:
    path = path.strip("/")
    return path + "/" if path else ""


def _scheme_of(scheme_name: str) -> Scheme | None:
    """The scheme a URI's `<name>://` names (`http` is `HTTPS`'s plain form)."""
    if scheme_name == "http":
        return Scheme.HTTPS
    return next((s for s in Scheme if s.value == scheme_name), None)


def _address(uri: str) -> SourceAddress | None:
    scheme_name, _, rest = uri.partition("://")
    scheme = _scheme_of(scheme_name)
    if scheme is None or not re.fullmatch(SCHEME_PATTERNS[scheme], uri):
        return None
    first, _, path = rest.partition("/")
    if scheme is Scheme.FILE:
        return SourceAddress(scheme, "", "/" + _prefix(path))
    if scheme is Scheme.AZ:
        container, _, path = path.partition("/")
        return SourceAddress(scheme, container, _prefix(path), account=first)
    if scheme is Scheme.HF:
        name, _, path = path.partition("/")
        name, _, revision = name.partition("@")
        return SourceAddress(scheme, f"{first}/{name}", _prefix(path), revision=revision)
    if scheme is Scheme.HTTPS and first.endswith(AZURE_BLOB_HOST) and scheme_name == "https":
        account = first[: -len(AZURE_BLOB_HOST)]
        container, _, path = path.partition("/")
        if re.fullmatch(r"[a-z0-9]+", account) and container:
            return SourceAddress(Scheme.AZ, container, _prefix(path), account=account)
        return None
    return SourceAddress(scheme, first, _prefix(path), secure=scheme_name != "http")


def shown_source(uri: str) -> str:
    """`uri` as a message may show it: a query, a fragment or user information (which could
    hold a SAS token or a password) replaced by `...`."""
    scheme, sep, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "...@" + authority.rpartition("@")[2]
    path = re.sub(r"[?#].*", "?...", path, flags=re.S)
    return f"{scheme}{sep}{authority}{slash}{path}" if sep else re.sub(r"[?#].*", "?...", uri)


def source_problem(uri: str) -> str | None:
    """Why `uri` is not a source, or None: the forms of its scheme, else every scheme's."""
    if _address(uri) is not None:
        return None
    scheme = _scheme_of(uri.partition("://")[0])
    if scheme is None:
        return "must be one of " + ", ".join(SCHEME_FORMS.values())
    if _CREDENTIAL_PARTS.search(uri) and scheme is not Scheme.FILE:
        return ("must not carry a query, a fragment or a user:password@ (a SAS token or a "
                "password would reach the status and the logs): give credentials through the "
                "DOD's model.credentials Secret")
    if scheme is Scheme.HTTPS and AZURE_BLOB_HOST in uri:
        scheme = Scheme.AZ
    return f"must be {SCHEME_FORMS[scheme]}"


def endpoint_problem(url: str) -> str | None:
    """Why `url` is not an endpoint (`loader.endpoint_url`), or None."""
    if re.fullmatch(ENDPOINT_PATTERN, url):
        return None
    if _CREDENTIAL_PARTS.search(url):
        return ("must not carry a query, a fragment or a user:password@ (they would reach the "
                "status and the logs): give credentials through the DOD's model.credentials "
                "Secret")
    return "must be an http:// or https:// URL, e.g. http://minio.storage:9000"


def parse_source_uri(uri: str, names: Names = document_names) -> SourceAddress:
    """Split `uri`; raise `SettingsError` naming the field as `names` spells it."""
    address = _address(uri)
    if address is None:
        field = names("loader.source")
        raise SettingsError(f"{field}={shown_source(uri)!r} is not a source URI: it "
                            f"{source_problem(uri)}",
                            hint=f"set {field} (or --source) to e.g. s3://models/flux-dev/ or "
                            "hf://black-forest-labs/FLUX.1-dev/")
    return address
