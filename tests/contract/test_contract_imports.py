"""The contract is what every plane may import: it must stay light and must import no plane.

Walks every module of `dlo_contract` and `dlo_cli` (not a hand-written list, so a new module is
covered the day it lands) and imports each in a fresh interpreter with the heavy outside systems
blocked; then checks from the source that the planes import each other only through the contract.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import dlo_cli
import dlo_contract
import pytest

BLOCKED = ("torch", "boto3", "botocore", "kopf", "kubernetes", "numpy", "safetensors", "diffusers")
PLANES = ("dlo_operator", "dlo_loader", "dlo_runtime")
REPO = Path(__file__).resolve().parents[2]


def _modules(package) -> list[str]:
    found = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        found.append(info.name)
    return sorted(found)


def test_the_walk_finds_the_contract_modules() -> None:
    modules = _modules(dlo_contract)
    assert {"dlo_contract.settings", "dlo_contract.names", "dlo_contract.documents",
            "dlo_contract.cache.publish", "dlo_contract.safetensors_header"} <= set(modules)


def test_every_contract_and_cli_module_imports_with_the_outside_systems_blocked() -> None:
    modules = _modules(dlo_contract) + _modules(dlo_cli)
    code = (
        "import importlib, json, sys\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
        "failed = {}\n"
        f"for module in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "    except Exception as exc:\n"
        "        failed[module] = f'{type(exc).__name__}: {exc}'\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{PLANES!r})\n"
        "print(json.dumps({'failed': failed, 'planes': loaded}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result == {"failed": {}, "planes": []}


def _imported_packages(source_dir: Path) -> dict[str, set[str]]:
    """For each file under `source_dir`, the top-level `dlo_*` packages it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted(source_dir.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = {n for n in names if n.startswith("dlo_")}
    return found


@pytest.mark.parametrize("package, folder", [
    ("dlo_operator", "operator"), ("dlo_loader", "loader_image"), ("dlo_runtime", "runtime"),
    ("dlo_contract", "contract"), ("dlo_cli", "cli"),
])
def test_planes_import_each_other_only_through_the_contract(package: str, folder: str) -> None:
    allowed = {package, "dlo_contract"}
    crossing = {path: sorted(names - allowed)
                for path, names in _imported_packages(REPO / folder / package).items()
                if names - allowed}
    assert crossing == {}


def test_every_digest_can_be_computed_wherever_entries_are_read() -> None:
    """`cache.verify: full` re-hashes an entry in the pod that maps it (the runtime) as well as
    in the loader: the modules the contract imports for a digest, lazily, are in both extras."""
    tree = ast.parse((REPO / "contract" / "dlo_contract" / "cache" / "digest.py").read_text())
    lazy = {(node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
            for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
            for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))}
    assert {"awscrt", "isal", "xxhash"} <= lazy
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def installed(extra: str) -> set[str]:
        """The distributions an extra brings, through the project's own extras it names."""
        names = set()
        for requirement in extras[extra]:
            own = re.fullmatch(rf"{project['name']}\[([\w,-]+)\]", requirement)
            names |= (set().union(*map(installed, own[1].split(","))) if own
                      else {re.split(r"[<>=\[ ;]", requirement)[0].lower()})
        return names

    for extra in ("loader", "runtime"):
        assert lazy <= installed(extra), (extra, sorted(lazy - installed(extra)))
