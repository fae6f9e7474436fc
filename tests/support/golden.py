"""Golden files of `dlo render examples/*.yaml`: any change to the manifests shows in review.

`python -m support.golden` (run by `make generate`, with `tests/` on the path) rewrites them; the
test in `tests/operator/test_render_golden.py` fails with a diff when they differ from a render.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "operator" / "golden"


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def golden_path(example: Path) -> Path:
    return GOLDEN / f"{example.stem}.rendered.yaml"


def render(example: Path) -> str:
    from dlo_operator.render import render_file

    return render_file(example)


def diff(example: Path) -> str:
    """Unified diff from the checked-in golden file to a fresh render ('' when equal)."""
    path = golden_path(example)
    old = path.read_text() if path.exists() else ""
    new = render(example)
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        str(path.relative_to(ROOT)), "dlo render " +
                                        str(example.relative_to(ROOT))))


def write_all() -> list[Path]:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    written = []
    for example in examples():
        path = golden_path(example)
        path.write_text(render(example))
        written.append(path)
    for stale in set(GOLDEN.glob("*.rendered.yaml")) - set(written):
        stale.unlink()
    return written


if __name__ == "__main__":
    for path in write_all():
        print(path.relative_to(ROOT))
    sys.exit(0)
