"""`dlo cache fill`: the init container's command line (contract C2).

Owns flags (the group's placement comes from `group_source`: flags, the torch.distributed
environment, or the operator's fill-group document), and the outputs
a pod relies on: the entry file for the main container, and a one-line JSON summary as the last
line of stdout and in the termination-message file. Settings come from `--config`, else
`$DLO_CONFIG`, else defaults; each flag overrides one field. Called by `dlo_cli.main`. Must not
print credentials: botocore's loggers stay at WARNING even with `--debug`, because its DEBUG lines
carry request headers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from dlo_loader.fill import FillRequest, fill
from dlo_loader.group_source import DEFAULT_MASTER_PORT, resolve_placement
from dlo_loader.progress import RankPrefixFilter
from dlo_contract.errors import DloError
from dlo_contract.settings import CONFIG_ENV, Settings, load_settings, replace_path
from dlo_contract.validation import validate

log = logging.getLogger(__name__)

DEFAULT_ENTRY_FILE = "/run/dlo/entry.json"
DEFAULT_SUMMARY_FILE = "/dev/termination-log"
_QUIET_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
# flag destination -> settings field it overrides
_OVERRIDES = {
    "source": "loader.source", "include": "loader.include", "endpoint_url": "loader.endpoint_url",
    "region": "loader.region", "path_style": "loader.path_style", "mode": "loader.mode",
    "readers": "loader.readers", "chunk_bytes": "loader.chunk_bytes",
    "rendezvous_timeout": "loader.rendezvous_timeout_s",
    "on_rendezvous_timeout": "loader.on_rendezvous_timeout", "cache_root": "cache.root",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help=f"settings document (default: ${CONFIG_ENV}, else built-in defaults)")
    add("--source", help="checkpoint prefix, s3://bucket/prefix/")
    add("--include", nargs="+", action="extend", metavar="GLOB",
        help="object globs relative to the prefix (repeatable; replaces the settings' list)")
    add("--endpoint-url", help="S3 endpoint URL (S3-compatible stores)")
    add("--region", help="S3 region")
    add("--path-style", action="store_true", default=None, help="path-style S3 addressing")
    add("--mode", choices=("multi-reader", "single-reader", "independent"))
    add("--readers", type=int, help="concurrent ranged GETs per loader")
    add("--chunk-bytes", type=int, help="bytes per chunk (planning, reads, hashing, exchange)")
    add("--cache-root", help="node cache root (the hostPath)")
    add("--rank", type=int, help="this loader's rank (default: $RANK, else 0)")
    add("--world-size", type=int, help="number of loaders (default: $WORLD_SIZE, else 1)")
    add("--master-addr", help="rank 0's address (default: $MASTER_ADDR)")
    add("--master-port", type=int, help=f"rank 0's port (default: $MASTER_PORT, else "
                                         f"{DEFAULT_MASTER_PORT})")
    add("--rendezvous-timeout", type=float, metavar="S", help="seconds to wait for all loaders")
    add("--on-rendezvous-timeout", choices=("independent", "fail"))
    add("--entry-file", default=os.environ.get("DLO_ENTRY_FILE", DEFAULT_ENTRY_FILE),
        help="where to write the entry document (default: %(default)s)")
    add("--summary-file", help=f"termination-message file (default: {DEFAULT_SUMMARY_FILE} "
                               "when it is writable)")


def run(args: argparse.Namespace) -> int:
    rank: int | None = None
    try:
        placement = resolve_placement(rank=args.rank, world_size=args.world_size,
                                      master_addr=args.master_addr, master_port=args.master_port)
        rank = placement.rank
        _install_log_filters(rank, placement.world_size)
        log.info("fill group from %s: rank %d of %d", placement.origin, rank,
                 placement.world_size)
        request = FillRequest(
            settings=load_fill_settings(args), rank=rank, world_size=placement.world_size,
            master_addr=placement.master_addr, master_port=placement.master_port,
            emit=_print_line,
        )
        result = fill(request)
        _write_atomically(Path(args.entry_file), json.dumps(result.entry_document()) + "\n")
    except Exception as exc:  # every failure becomes the one-line summary and exit status 1
        return _report_failure(args, rank, exc)
    _finish(args, result.summary())
    return 0


def load_fill_settings(args: argparse.Namespace) -> Settings:
    """The settings document with this command's flags applied, validated."""
    path = args.config or os.environ.get(CONFIG_ENV)
    settings = load_settings(path) if path else Settings()
    for dest, field in _OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            settings = replace_path(settings, field, value)
    return validate(settings)


def _install_log_filters(rank: int, world_size: int) -> None:
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    prefix = RankPrefixFilter(rank, world_size)
    for handler in logging.getLogger().handlers:
        handler.addFilter(prefix)


def _print_line(line: str) -> None:
    print(line, flush=True)


def _report_failure(args: argparse.Namespace, rank: int | None, exc: Exception) -> int:
    message = str(exc)
    if isinstance(exc, DloError):
        if exc.hint:
            message += f" (hint: {exc.hint})"
        log.error("%s", message, exc_info=getattr(args, "debug", False))
    else:
        message = f"{type(exc).__name__}: {message}"
        log.exception("fill failed unexpectedly")
    _finish(args, {"status": "error", "rank": rank, "error": " ".join(message.split())})
    return 1


def _finish(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    line = json.dumps(summary)
    target = args.summary_file
    if target is None and os.access(DEFAULT_SUMMARY_FILE, os.W_OK):
        target = DEFAULT_SUMMARY_FILE
    if target:
        try:
            Path(target).write_text(line + "\n")
        except OSError as exc:
            log.warning("cannot write the summary to %s: %s", target, exc.strerror)
    print(line, flush=True)


def _write_atomically(path: Path, text: str) -> None:
    """The main container must never read half an entry document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
