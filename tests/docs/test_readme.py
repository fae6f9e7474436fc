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
