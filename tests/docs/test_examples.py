"""Every example the README presents as runnable runs here, as a user would run it.

`examples/*.py` run as real processes with the suite's interpreter; the YAML examples go through
`dlo render` and the CRD's schema and CEL rules in `tests/operator` and `tests/crd`. An example
that writes a cross-plane document by hand would drift from the contract unnoticed; run, it
fails with the plane's own error.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_example_scripts() -> None:
    assert [p.name for p in SCRIPTS] == ["serve_example.py"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_script_runs_and_checks_its_result(script: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=_clean_environment())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "equal to the resident model's bit for bit" in done.stdout


def _clean_environment() -> dict[str, str]:
    """The user's environment less what a dlo pod would set: the example sets those itself."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DLO_")}


def readme_python_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, re.S)


def test_the_readme_python_blocks_name_only_what_dlo_has() -> None:
    """The README's server snippets are fragments (a pipeline, `...`), so they are parsed, not
    run: every `dlo_*` import must resolve, and every attribute used of a dlo module must
    exist, so a rename fails here rather than in a user's server."""
    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    checked = 0
    for block in blocks:
        tree = ast.parse(block)
        modules: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("dlo_"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    modules[alias.asname or alias.name] = value
                    checked += 1
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                assert hasattr(modules[node.value.id], node.attr), (
                    f"README uses {node.value.id}.{node.attr}, which dlo does not have")
                checked += 1
    assert checked >= 7
