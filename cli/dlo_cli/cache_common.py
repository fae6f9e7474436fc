"""What every `dlo cache` subcommand shares: the `--root` option and its default.

Owns the rule "explicit `--root`, else the settings document's `cache.root` when a document
exists (`$DLO_CONFIG` or the default mount path), else the built-in default root". Called by
`cli_ls`, `cli_verify` and `cli_gc`. Must not print or touch the cache.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dlo_contract.cache.layout import CacheRoot
from dlo_contract.settings import (
    CONFIG_ENV,
    DEFAULT_CACHE_ROOT,
    DEFAULT_CONFIG_PATH,
    CacheConfig,
    load_settings,
)
from dlo_contract.validation import validate


def add_root_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root", metavar="DIR", default=None,
        help=f"cache root (default: cache.root of ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH} when "
        f"present, else {DEFAULT_CACHE_ROOT})",
    )


def settings_cache_config() -> CacheConfig:
    """The validated settings document's cache section; defaults when no document exists.

    An explicit `$DLO_CONFIG` must be readable (a typo should fail, not fall back silently), and
    a document the loader would refuse is refused here too (a negative `cache.max_bytes` must
    not pass as a limit)."""
    if os.environ.get(CONFIG_ENV) or Path(DEFAULT_CONFIG_PATH).exists():
        return validate(load_settings()).cache
    return CacheConfig()


def resolve_root(args: argparse.Namespace) -> CacheRoot:
    return CacheRoot(args.root if args.root else settings_cache_config().root)

