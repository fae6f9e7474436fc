"""The README's configuration reference is the CRD's: every spec field, its type and default."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- configuration reference: generated from crds/, checked by tests/docs -->"
END = "<!-- end of configuration reference -->"
NESTED_OBJECTS_DEPTH = 3


def reference_rows(schema: dict[str, Any], prefix: str = "spec") -> list[str]:
    """One table row per leaf field (Kubernetes core types such as `resources` stay one row)."""
    rows = []
    for name, field in schema.get("properties", {}).items():
        path = f"{prefix}.{name}"
        if "properties" in field and path.count(".") < NESTED_OBJECTS_DEPTH:
            rows += reference_rows(field, path)
            continue
        default = json.dumps(field["default"]) if "default" in field else "required"
        allowed = f" One of: {', '.join(map(str, field['enum']))}." if "enum" in field else ""
        description = " ".join(field.get("description", "").split())
        rows.append(f"| `{path}` | {field.get('type', 'object')} | `{default}` | "
                    f"{description}{allowed} |")
    return rows


def expected_reference() -> str:
    crd = yaml.safe_load((ROOT / "crds" / "dlo.dev_diffusionoffloaddeployments.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + reference_rows(spec))


def test_readme_configuration_reference_matches_the_crd() -> None:
    readme = (ROOT / "README.md").read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), readme, re.S)
    assert found, "README.md lacks the configuration reference markers"
    assert found.group(1) == expected_reference(), (
        "README configuration reference is stale; regenerate it with "
        "`python tests/docs/test_readme.py > /tmp/ref.md` and paste it between the markers"
    )


def test_readme_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```", 2)[1]
    assert first_block.split() == ["make", "demo", "make", "test"]


if __name__ == "__main__":
    print(expected_reference())
