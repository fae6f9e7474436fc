"""The README's configuration reference is the CRD's: every spec field, its type and default."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dlo_contract.crd import reference_table
from dlo_contract.generate import BEGIN, END

ROOT = Path(__file__).resolve().parents[2]


def test_readme_configuration_reference_matches_the_crd() -> None:
    readme = (ROOT / "README.md").read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), readme, re.S)
    assert found, "README.md lacks the configuration reference markers"
    crd = yaml.safe_load((ROOT / "crds" / "dlo.dev_diffusionoffloaddeployments.yaml").read_text())
    assert found.group(1) == reference_table(crd), (
        "README configuration reference is stale; run `make generate`")


def test_readme_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```", 2)[1]
    assert first_block.split() == ["make", "demo", "make", "test"]


def test_readme_sources_table_names_every_scheme_and_the_variables_it_reads() -> None:
    """The table of schemes is the contract's: each scheme's URI and each credential variable
    the operator writes for it (`dlo_contract.source_credentials`) appear in its row."""
    from dlo_contract.source_credentials import SCHEME_CREDENTIALS

    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Sources:", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) == len(SCHEME_CREDENTIALS)
    for scheme, credentials in SCHEME_CREDENTIALS.items():
        (row,) = [r for r in rows if r.split("|")[2].strip().startswith(f"`{scheme.value}://")]
        assert all(f"`{name}`" in row for name in credentials.env), (scheme, row)
