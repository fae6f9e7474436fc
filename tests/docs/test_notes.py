"""Every `[Note: ...]` the code or the docs cite is defined: a block that opens with its name
(a docstring's or a comment's paragraph, or a line of the docs), in the module the citation
names when it names one (`[Note: ring] in ring`)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("contract", "cli", "runtime", "loader_image", "operator", "server", "bench")
NOTE = re.compile(r"\[Note:\s+([^\]]+?)\](?:\s+in\s+`([\w.]+)`)?")
OPENS = re.compile(r"^\s*(?:#\s*|\"\"\"|[-*]\s+)?\[Note:\s+([^\]]+?)\]", re.M)


def _name(raw: str) -> str:
    """A note's name as one line: a name cut by a line break (and a comment's `#`) rejoined."""
    return " ".join(re.sub(r"(^|\n)\s*#", " ", raw).split())


def _stem(module: str) -> str:
    """`plan.py`, `dlo_loader.plan` and `plan` all name the file `plan`."""
    return module.removesuffix(".py").rsplit(".", 1)[-1]


def _sources() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return files + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def notes() -> tuple[dict[str, set[str]], list[tuple[str, str, str | None]]]:
    """Where each note is defined (the stems of the files that open it), and every citation:
    (file, note, module it names or None)."""
    defined: dict[str, set[str]] = defaultdict(set)
    cited = []
    for path in _sources():
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        openings = {m.start(1) for m in OPENS.finditer(text)}
        for found in NOTE.finditer(text):
            name = _name(found.group(1))
            if name == "...":  # how the docs speak of notes in general
                continue
            if found.start(1) in openings:
                defined[name].add(path.stem)
            else:
                cited.append((where, name, found.group(2)))
    return defined, cited


def test_every_cited_note_is_defined_where_it_is_said_to_be() -> None:
    defined, cited = notes()
    assert cited, "no citation found: the pattern no longer matches how notes are cited"
    undefined = sorted({(where, name) for where, name, _ in cited if name not in defined})
    assert undefined == [], "cited, defined nowhere"
    misplaced = sorted({(where, name, module) for where, name, module in cited
                        if module is not None and _stem(module) not in defined[name]})
    assert misplaced == [], "cited in a module that does not define it"
