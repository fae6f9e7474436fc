"""Which settings fields a rendered document must carry: the document's canonical form.

The operator names a DOD's settings by a digest of the document it renders (the revision), and
every pod template carries that name. A release that adds a settings field must not rename every
DOD's settings, or every serving pod restarts on the upgrade although no one changed anything.
So each field is one of two kinds, recorded in `settings_history.json` (written by `make
generate`, checked by `make check-generated`):

- `always`: fields the document always carries (those that existed when the record began, and
  fields whose default a release changed);
- `introduced`: fields added later, each with the default it was added with. The document
  carries such a field only where its value differs from that default.

A reader fills a missing field with its default, which for an `introduced` field is the default
it was added with; so the canonical document means the same to every reader, an older reader
never meets a field it does not know unless a DOD sets it (and then refuses it, naming it), and
a revision always names one content. A release that changes the default of an `introduced`
field moves it to `always` (`record` does so): the document then carries the new value, the
revision of every DOD that relies on the default changes and its pods restart, because its
behaviour changes. Pure; imported by the operator and `dlo_contract.generate`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlo_contract.schema import default_of, leaves, plain
from dlo_contract.settings import Settings

HISTORY_PATH = Path(__file__).with_name("settings_history.json")
"""The record, relative to the repository root as `HISTORY_FILE`."""
HISTORY_FILE = "contract/dlo_contract/settings_history.json"


@dataclass(frozen=True, kw_only=True)
class SettingsHistory:
    always: frozenset[str]
    """Dotted paths of the fields every document carries."""
    introduced: Mapping[str, Any] = field(default_factory=dict)
    """Dotted path -> the default (JSON form) a later field was added with."""

    def to_json(self) -> str:
        return json.dumps({"always": sorted(self.always), "introduced": dict(
            sorted(self.introduced.items()))}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SettingsHistory:
        data = json.loads(text)
        return cls(always=frozenset(data["always"]), introduced=dict(data["introduced"]))


def current_defaults() -> dict[str, Any]:
    """Dotted path -> the declared default (JSON form) of every settings field."""
    return {leaf.path: plain(default_of(leaf.info)) for leaf in leaves(Settings)}


def record(previous: SettingsHistory | None,
           defaults: Mapping[str, Any] | None = None) -> SettingsHistory:
    """The record after this release: a new field is `introduced` at its default; an
    `introduced` field whose default changed moves to `always`. Without a previous record
    every field is `always` (the record's start)."""
    defaults = current_defaults() if defaults is None else defaults
    if previous is None:
        return SettingsHistory(always=frozenset(defaults))
    changed = {path for path, was in previous.introduced.items()
               if path in defaults and defaults[path] != was}
    introduced = {path: was for path, was in previous.introduced.items() if path not in changed}
    introduced.update({path: value for path, value in defaults.items()
                       if path not in previous.always and path not in previous.introduced})
    return SettingsHistory(always=previous.always | changed, introduced=introduced)


def load_history(path: Path = HISTORY_PATH) -> SettingsHistory:
    return SettingsHistory.from_json(path.read_text())


HISTORY = load_history()


def canonical(settings: Settings, history: SettingsHistory | None = None) -> dict[str, Any]:
    """`settings` as the document carries it: `introduced` fields at the default they were
    added with left out."""
    data = settings.to_dict()
    for path, was in (history or HISTORY).introduced.items():
        _drop_default(data, path.split("."), was)
    return data


def _drop_default(data: dict[str, Any], path: list[str], was: Any) -> None:
    """Remove `path` from `data` where it holds `was`, and a section it leaves empty."""
    head, *rest = path
    if not rest:
        if head in data and data[head] == was:
            del data[head]
        return
    section = data.get(head)
    if isinstance(section, dict):
        _drop_default(section, rest, was)
        if not section:
            del data[head]


def canonical_json(settings: Settings, history: SettingsHistory | None = None) -> str:
    """The canonical document's text (keys sorted, as `Settings.to_json` writes them)."""
    return json.dumps(canonical(settings, history), indent=2, sort_keys=True) + "\n"
