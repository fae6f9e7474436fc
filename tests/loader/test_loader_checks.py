"""The last check before a fill publishes: every chunk of the plan has a digest.

A path that skips a chunk (an exchange or a re-plan after a lost member that loses track of one)
leaves the preallocated zeros in the file and no digest for it; the group's digest comparison
cannot see that when every rank skipped it, or when one survivor finishes alone. A node that
publishes refuses in its own checks (`check_files`), whose error `conclude` hands to the group.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from dlo_loader.checks import check_files, conclude, require_every_chunk
from dlo_loader.errors import LoaderError

PLAN = SimpleNamespace()
"""A plan check_files never reads: its guard refuses first."""


def test_a_chunk_never_written_stops_the_fill_before_it_publishes(tmp_path: Path) -> None:
    digests = ["a1", None, "c3", ""]
    with pytest.raises(LoaderError) as caught:  # the headers are never read: no file exists
        conclude(None, digests, lambda: check_files(tmp_path, PLAN, digests, "s3://m/"))
    assert str(caught.value) == ("2 chunk(s) of the plan were never written on this node "
                                 "(chunks 1, 3); nothing was published")


def test_every_chunk_written_passes_the_guard() -> None:
    require_every_chunk(["a1", "b2"])
