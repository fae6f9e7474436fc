"""`dlo cache ls`: one line per entry (id, kind, bytes, last use, in use or not).

Owns the listing's output format (a table, or JSON with `--json` for scripts). Called by the
`dlo` entry point. Must not modify the cache: the in-use probe only tries a lock and drops it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from dataclasses import asdict

from dlo_cli.cache_common import add_root_argument, resolve_root
from dlo_contract.cache.evict import list_entries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _when(stamp: float) -> str:
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).isoformat(timespec="seconds")


def run(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    infos = list_entries(root)
    if args.json:
        print(json.dumps([asdict(info) for info in infos], indent=1))
        return 0
    print(f"{'ENTRY':<64}  {'KIND':<10}  {'BYTES':>14}  {'LAST USED (UTC)':<25}  IN USE")
    for info in infos:
        print(
            f"{info.entry_id:<64}  {info.kind:<10}  {info.bytes:>14}  {_when(info.last_used):<25}  "
            f"{'yes' if info.in_use else 'no'}"
        )
    total = sum(info.bytes for info in infos)
    print(f"{len(infos)} entries, {total} bytes in {root.path}")
    return 0
