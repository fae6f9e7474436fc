"""`dlo cache verify ENTRY [--full]`: check one entry against its manifest.

Owns the verify command's output: `ok ...` and exit 0, or the first problem (file, and chunk for
chunked files), the number of problems, and exit 1. Plain verify checks the manifest and file
sizes; `--full` re-hashes every file or chunk. Called by the `dlo` entry point. Must not repair
or remove anything.
"""

from __future__ import annotations

import argparse

from dlo_cli.cache_common import add_root_argument, resolve_root
from dlo_contract.cache.entry import verify_entry
from dlo_contract.cache.errors import CacheError
from dlo_contract.cache.layout import CacheRoot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser)
    parser.add_argument("entry", metavar="ENTRY", help="entry id, or a unique prefix of one")
    parser.add_argument("--full", action="store_true", help="re-hash every file and chunk")


def resolve_entry(root: CacheRoot, text: str) -> str:
    """An exact id, or the one id that starts with `text` (ids are long to type)."""
    ids = root.entry_ids()
    if text in ids:
        return text
    matches = [i for i in ids if i.startswith(text)] if text else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CacheError(
            f"entry prefix {text!r} matches {len(matches)} entries in {root.path}",
            hint="give more characters of the id",
        )
    raise CacheError(
        f"cache entry {text} not found in {root.path}",
        hint=f"list entries with: dlo cache ls --root {root.path}",
    )


def run(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    entry = resolve_entry(root, args.entry)
    problems = verify_entry(root, entry, full=args.full)
    mode = "full" if args.full else "sizes"
    if not problems:
        print(f"ok {entry} ({mode})")
        return 0
    print(f"corrupt {entry} ({mode}): {problems[0]}")
    if len(problems) > 1:
        print(f"{len(problems) - 1} more problem(s):")
        for problem in problems[1:]:
            print(f"  {problem}")
    return 1
