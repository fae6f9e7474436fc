"""The settings record and the canonical document: a field a release adds is left out of the
document while it holds the default it was added with; a changed default makes it a field the
document always carries; readers fill what is left out."""

from __future__ import annotations

import json

from dlo_contract.settings import LoaderConfig, Settings
from dlo_contract.settings_history import (
    HISTORY,
    HISTORY_PATH,
    SettingsHistory,
    canonical,
    canonical_json,
    current_defaults,
    record,
)

ADDED = "loader.peer_timeout_s"
"""A field standing for one a release adds."""
BEFORE = SettingsHistory(always=HISTORY.always - {ADDED})
"""The record of the release before it."""


def test_the_record_starts_with_every_field_always_carried_and_is_checked_in() -> None:
    assert record(None).always == frozenset(current_defaults())
    assert record(None).introduced == {}
    assert SettingsHistory.from_json(HISTORY_PATH.read_text()) == record(HISTORY)


def test_a_new_field_is_introduced_at_its_default_and_stays_so() -> None:
    added = record(BEFORE)
    assert added.introduced == {ADDED: 10.0} and ADDED not in added.always
    assert record(added) == added


def test_a_changed_default_of_an_introduced_field_makes_it_always_carried() -> None:
    changed = record(record(BEFORE), {**current_defaults(), ADDED: 20.0})
    assert ADDED in changed.always and ADDED not in changed.introduced


def test_the_document_leaves_out_an_introduced_field_at_the_default_it_was_added_with() -> None:
    added = record(BEFORE)
    at_default = canonical(Settings(), added)
    assert "peer_timeout_s" not in at_default["loader"]
    set_by_user = Settings(loader=LoaderConfig(peer_timeout_s=20.0))
    assert canonical(set_by_user, added)["loader"]["peer_timeout_s"] == 20.0
    assert canonical(Settings(), HISTORY) == Settings().to_dict()
    assert canonical_json(Settings(), HISTORY) == Settings().to_json()


def test_the_document_of_a_release_that_adds_a_field_is_what_the_release_before_wrote() -> None:
    """An older reader (which refuses fields it does not know) reads it unchanged."""
    before = Settings().to_dict()
    del before["loader"]["peer_timeout_s"]
    assert json.loads(canonical_json(Settings(), record(BEFORE))) == before


def test_a_reader_fills_a_left_out_field_with_its_default() -> None:
    settings = Settings(loader=LoaderConfig(source="s3://models/flux/", readers=4))
    assert Settings.from_json(canonical_json(settings, record(BEFORE))) == settings


def test_a_section_a_release_adds_whole_is_left_out_at_its_defaults() -> None:
    section = {path: value for path, value in current_defaults().items()
               if path.startswith("parallel.")}
    added = record(SettingsHistory(always=HISTORY.always - set(section)))
    assert "parallel" not in canonical(Settings(), added)
    assert Settings.from_json(canonical_json(Settings(), added)) == Settings()
