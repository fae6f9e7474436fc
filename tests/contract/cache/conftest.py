"""Node-cache fixtures for these tests."""

from support.cache_fixtures import root, tmpfs, workers  # noqa: F401  (pytest fixtures)
