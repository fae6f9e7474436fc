"""The generated files are up to date, and a field changed in one place only fails the check
with a diff naming the field (what `make check-generated` runs in CI)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dlo_contract import generate
from dlo_contract.settings import LoaderConfig

ROOT = Path(__file__).resolve().parents[3]


def _copy_tree(tmp_path: Path) -> Path:
    for name in (*generate.CRD_FILES, generate.README, generate.HISTORY_FILE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_checked_in_files_equal_what_the_declarations_generate() -> None:
    assert generate.check(ROOT) == ""


def test_a_default_changed_in_the_schema_only_fails_with_a_diff_naming_the_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LoaderConfig.model_fields["readers"], "default", 32)
    found = generate.check(ROOT)
    changed = [line[0] + line[1:].strip() for line in found.splitlines()
               if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert changed.count("+default: 32") == changed.count("-default: 16") == 2
    assert "readers:" in found  # the hunk's context names the CRD field
    assert any(line.startswith("+| `spec.loader.readers` | integer | `32` |") for line in changed)
    assert len(changed) == 6, found  # CRD, chart copy, README: one line out, one line in each
    for name in (*generate.CRD_FILES, generate.README):
        assert f"--- {name} (checked in)" in found


def test_a_default_changed_in_the_crd_only_fails(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_tree(tmp_path)
    crd = root / generate.CRD_FILES[0]
    text = crd.read_text()
    assert text.count("default: 16777216") == 1
    crd.write_text(text.replace("default: 16777216", "default: 8388608"))
    assert generate.main(["--check", "--root", str(root)]) == 1
    out, err = capsys.readouterr()
    changed = [line[0] + line[1:].strip() for line in out.splitlines()
               if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert changed == ["-default: 8388608", "+default: 16777216"]
    assert "chunkBytes:" in out
    assert "run `make generate`" in err
    assert generate.main(["--root", str(root)]) == 0
    assert generate.main(["--check", "--root", str(root)]) == 0
