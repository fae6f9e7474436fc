"""`model.source`: every scheme's URI parses to what it names, the CRD's pattern accepts exactly
what the parser accepts, and a refusal names the field, the value and the scheme's form."""

from __future__ import annotations

import re

import pytest

from dlo_contract.schema import SettingsError
from dlo_contract.settings import Settings
from dlo_contract.source_credentials import Scheme
from dlo_contract.source_uri import SOURCE_PATTERN, SourceAddress, parse_source_uri
from dlo_contract.validation import validate

GOOD = {
    "s3://models/flux-dev/": SourceAddress(Scheme.S3, "models", "flux-dev/"),
    "s3://models/": SourceAddress(Scheme.S3, "models", ""),
    "file:///models/flux-dev/": SourceAddress(Scheme.FILE, "", "/models/flux-dev/"),
    "file:///mnt/.share/v1.0": SourceAddress(Scheme.FILE, "", "/mnt/.share/v1.0/"),
    "gs://models/flux-dev": SourceAddress(Scheme.GS, "models", "flux-dev/"),
    "az://acct/models/flux-dev/": SourceAddress(Scheme.AZ, "models", "flux-dev/", account="acct"),
    "az://acct/models": SourceAddress(Scheme.AZ, "models", "", account="acct"),
    "https://acct.blob.core.windows.net/models/flux-dev/": SourceAddress(
        Scheme.AZ, "models", "flux-dev/", account="acct"),
    "https://cdn.example.com:8443/m/flux-dev/": SourceAddress(
        Scheme.HTTPS, "cdn.example.com:8443", "m/flux-dev/"),
    "http://127.0.0.1:8080/flux-dev/": SourceAddress(
        Scheme.HTTPS, "127.0.0.1:8080", "flux-dev/", secure=False),
    "hf://black-forest-labs/FLUX.1-dev": SourceAddress(Scheme.HF, "black-forest-labs/FLUX.1-dev",
                                                       ""),
    "hf://org/repo@0ef5fff/transformer/": SourceAddress(Scheme.HF, "org/repo", "transformer/",
                                                        revision="0ef5fff"),
}
BAD = {
    "": "must be one of s3://bucket/prefix/",
    "ftp://host/x/": "must be one of s3://bucket/prefix/",
    "s3://": "must be s3://bucket/prefix/",
    "file://relative/x/": "must be file:///path/ (absolute, without '.', '..' or '//')",
    "file:///models/../etc/": "must be file:///path/ (absolute, without '.', '..' or '//')",
    "file:///": "must be file:///path/",
    "gs:///prefix/": "must be gs://bucket/prefix/",
    "az://acct": "must be az://account/container/prefix/",
    "https://Acct.blob.core.windows.net/c/": "(account in lower case)",
    "https://host": "must be https://host/path/",
    "hf://org": "must be hf://org/repo[@revision]/",
    "hf://org/repo@": "must be hf://org/repo[@revision]/",
}


@pytest.mark.parametrize("uri", GOOD)
def test_each_scheme_parses_to_what_it_names(uri: str) -> None:
    address = parse_source_uri(uri)
    assert address == GOOD[uri]
    assert parse_source_uri(str(address)) == address  # the canonical URI names the same source


@pytest.mark.parametrize("uri", BAD)
def test_a_bad_source_is_refused_naming_the_field_the_value_and_the_form(uri: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_source_uri(uri)
    assert str(caught.value).startswith(f"loader.source={uri!r} is not a source URI: it ")
    assert BAD[uri] in str(caught.value)


def test_the_crd_pattern_accepts_what_the_parser_accepts() -> None:
    """The one case apart: an upper-case Azure account passes the pattern (it is an https://
    URL) and the validator refuses it."""
    for uri in GOOD:
        assert re.fullmatch(SOURCE_PATTERN, uri), uri
    assert [uri for uri in BAD if re.fullmatch(SOURCE_PATTERN, uri)] == [
        "https://Acct.blob.core.windows.net/c/"]


def test_the_validator_refuses_a_bad_source_with_the_other_problems() -> None:
    settings = Settings.from_dict({"loader": {"source": "hf://org"}})
    with pytest.raises(SettingsError, match=r"^invalid settings: loader.source='hf://org' must "
                       r"be hf://org/repo\[@revision\]/$"):
        validate(settings)
    assert validate(Settings()) == Settings()  # no source yet: a runtime's own document


@pytest.mark.parametrize("uri", [
    "https://acct.blob.core.windows.net/models/flux/?sv=2024&sig=s3cr3t",
    "https://reader:s3cr3t@cdn.example.com/models/flux/",
    "gs://models/flux/?s3cr3t", "hf://org/repo/#s3cr3t"])
def test_a_source_carrying_credentials_is_refused_without_showing_them(uri: str) -> None:
    """A URI reaches the settings document, the status and the logs: a SAS token or a password
    in it is refused, and the refusal does not repeat it."""
    assert not re.fullmatch(SOURCE_PATTERN, uri)
    with pytest.raises(SettingsError) as caught:
        parse_source_uri(uri)
    assert "s3cr3t" not in str(caught.value)
    assert "give credentials through the DOD's model.credentials Secret" in str(caught.value)
    with pytest.raises(SettingsError) as caught:
        validate(Settings.from_dict({"loader": {"source": uri}}))
    assert "s3cr3t" not in str(caught.value)


@pytest.mark.parametrize(("url", "problem"), [
    ("https://reader:s3cr3t@minio.storage:9000", "must not carry a query, a fragment or a "
     "user:password@"),
    ("http://127.0.0.1:10000/devstoreaccount1?sig=s3cr3t", "must not carry a query"),
    ("minio.storage:9000", "must be an http:// or https:// URL"),
])
def test_an_endpoint_carrying_credentials_or_of_no_url_is_refused(url: str, problem: str) -> None:
    with pytest.raises(SettingsError) as caught:
        validate(Settings.from_dict({"loader": {"source": "s3://m/p/", "endpoint_url": url}}))
    assert str(caught.value).startswith("invalid settings: loader.endpoint_url=")
    assert problem in str(caught.value) and "s3cr3t" not in str(caught.value)


def test_an_emulator_endpoint_with_a_path_is_an_endpoint() -> None:
    settings = Settings.from_dict({"loader": {
        "source": "az://devstoreaccount1/models/p/",
        "endpoint_url": "http://127.0.0.1:10000/devstoreaccount1"}})
    assert validate(settings) == settings
