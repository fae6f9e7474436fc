"""`dlo render` of every example equals its golden file (regenerate with `make generate`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import golden


def test_every_example_has_a_golden_file_and_no_golden_file_is_stale() -> None:
    assert sorted(golden.GOLDEN.glob("*.rendered.yaml")) == [
        golden.golden_path(e) for e in golden.examples()]


@pytest.mark.parametrize("example", golden.examples(), ids=lambda p: p.stem)
def test_render_matches_the_golden_file(example: Path) -> None:
    changed = golden.diff(example)
    assert changed == "", f"manifests changed; review and run `make generate`:\n{changed}"
