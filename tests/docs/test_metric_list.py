"""The README's metric list is generated from the metric definitions and is current."""

from __future__ import annotations

from pathlib import Path

from dlo_cli import metrics_reference

ROOT = Path(__file__).parents[2]


def test_readme_metric_list_is_current_and_names_every_metric() -> None:
    assert metrics_reference.main(["--check", "--root", str(ROOT)]) == 0
    text = (ROOT / "README.md").read_text()
    for _, _, module in metrics_reference._planes():
        table = __import__(module, fromlist=["METRICS"]).METRICS
        assert all(f"| `{name}` |" in text for name in table)
        assert all(name.startswith("dlo_") for name in table)


def test_a_stale_list_is_caught(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    (tmp_path / "README.md").write_text(text.replace("dlo_loader_stalls_total", "dlo_x"))
    assert metrics_reference.main(["--check", "--root", str(tmp_path)]) == 1
