"""`dlo cache fill`: the loader sidecar's command line (contract C2).

Owns flags (the fill group's placement comes from `group_source`: flags, `RANK`/`WORLD_SIZE`/
`MASTER_ADDR`/`MASTER_PORT`, or the operator's fill-group document), and the outputs
a pod relies on: the entry file for the main container, and a one-line JSON summary as the last
line of stdout and in the termination-message file. Settings come from `--config`, else
`$DLO_CONFIG`, else defaults; each settings flag overrides one field and is built from that
field's declaration (`cli=` in `dlo_contract.settings`: name, type, choices, help). Called by
`dlo_cli.main`. Must not
print credentials: botocore's loggers stay at WARNING even with `--debug`, because its DEBUG lines
carry request headers.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import tempfile
import threading
import typing
from pathlib import Path

from dlo_loader.fill import TRANSFER_MODULES, FillRequest, fill
from dlo_loader.fill_secret import read_fill_secret
from dlo_loader import metrics
from dlo_loader.group_source import peer_holders, resolve_placement, this_member
from dlo_loader.metrics import Endpoint
from dlo_loader.peer_serve import EntryServer, Throttle
from dlo_loader.progress import RankPrefixFilter
from dlo_loader.termination import EXIT_TERMINATED, Terminated, Termination, installed
from dlo_contract.cache import EntryHandle, open_entry
from dlo_contract.documents import FillStatus, FillSummary
from dlo_contract.errors import DloError
from dlo_contract.names import (
    CONFIG_ENV,
    DEFAULT_ENTRY_FILE,
    DEFAULT_RENDEZVOUS_PORT,
    DEFAULT_SUMMARY_FILE,
    ENTRY_FILE_ENV,
    FILL_SECRET_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    RANK_ENV,
    WORLD_SIZE_ENV,
)
from dlo_contract.schema import Leaf, base_type, leaves
from dlo_contract.settings import Settings, load_settings, replace_path
from dlo_contract.validation import validate

log = logging.getLogger(__name__)

YIELD_NICE = 10
"""How much `--yield-cpu` raises the loader's nice value ([Note: the sidecar yields the CPU])."""
EXIT_AT_ONCE = True
"""`dlo cache fill` ends its process right after the summary (see `dlo_cli.main`)."""
_QUIET_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
OVERRIDES: dict[str, Leaf] = {
    leaf.meta.cli.removeprefix("--").replace("-", "_"): leaf
    for leaf in leaves(Settings) if leaf.meta.cli
}
"""Flag destination -> the settings field it overrides, from the `cli=` declarations."""


def _add_override(parser: argparse.ArgumentParser, leaf: Leaf) -> None:
    """One flag from a field's declaration: its type, its choices, its description as help."""
    flag = leaf.meta.cli or ""
    annotation = base_type(leaf.annotation)
    help_text = f"{leaf.info.description.rstrip('.')} (settings: {leaf.path})".replace("%", "%%")
    if annotation is bool:
        parser.add_argument(flag, action="store_true", default=None, help=help_text)
    elif typing.get_origin(annotation) is typing.Literal:
        parser.add_argument(flag, choices=typing.get_args(annotation), help=help_text)
    elif typing.get_origin(annotation) is tuple:
        parser.add_argument(flag, nargs="+", action="extend", metavar="GLOB",
                            help=help_text + "; repeatable, replaces the document's list")
    else:
        parser.add_argument(flag, type=annotation, help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help=f"settings document (default: ${CONFIG_ENV}, else built-in defaults)")
    for leaf in OVERRIDES.values():
        _add_override(parser, leaf)
    add("--rank", type=int, help=f"this loader's rank (default: ${RANK_ENV}, else 0)")
    add("--world-size", type=int, help=f"number of loaders (default: ${WORLD_SIZE_ENV}, else 1)")
    add("--master-addr", help=f"rank 0's address (default: ${MASTER_ADDR_ENV})")
    add("--master-port", type=int, help=f"rank 0's port (default: ${MASTER_PORT_ENV}, else "
                                         f"{DEFAULT_RENDEZVOUS_PORT})")
    add("--entry-file", default=os.environ.get(ENTRY_FILE_ENV, DEFAULT_ENTRY_FILE),
        help="where to write the entry document (default: %(default)s)")
    add("--summary-file", help=f"termination-message file (default: {DEFAULT_SUMMARY_FILE} "
                               "when it is writable)")
    add("--yield-cpu", action="store_true",
        help=f"run at a lower CPU priority (nice +{YIELD_NICE}): beside a starting server, "
             "whose start is the way to the first request, while the fill mostly waits on the "
             "network")
    add("--keep-running", action="store_true",
        help="after the entry is published, stay up (serving /metrics, and the entry to the "
             "loaders refilling other nodes from it) until SIGTERM or SIGINT, "
             "holding the entry in use so that no fill on the node evicts it: a pod's native "
             "sidecar, which the kubelet would restart if it exited")


def run(args: argparse.Namespace) -> int:
    """`dlo cache fill`: its exit status (0, 1 for a failed fill, `EXIT_TERMINATED` for one
    SIGTERM ended: see [Note: SIGTERM mid-fill] in `termination`). The rank prefix it puts on
    log lines and its signal handlers go again when it returns (a process may call it more than
    once)."""
    try:
        with installed() as termination:  # first: no SIGTERM may find the default handler
            return _fill_command(args, termination)
    finally:
        _remove_log_filters()


def _fill_command(args: argparse.Namespace, termination: Termination) -> int:
    rank: int | None = None
    endpoint: Endpoint | None = None
    entry: EntryHandle | None = None
    if args.yield_cpu:
        _yield_cpu()
    preload_transfer_modules()
    try:
        placement = resolve_placement(rank=args.rank, world_size=args.world_size,
                                      master_addr=args.master_addr, master_port=args.master_port)
        rank = placement.rank
        _install_log_filters(rank, placement.world_size)
        log.info("fill group from %s: rank %d of %d", placement.origin, rank,
                 placement.world_size)
        settings = load_fill_settings(args)
        secret = read_fill_secret()
        endpoint = _serve_metrics(settings.loader.metrics_port, secret)
        request = FillRequest(
            settings=settings, rank=rank, world_size=placement.world_size,
            master_addr=placement.master_addr, master_port=placement.master_port,
            emit=_print_line, member=this_member(rank), holders=peer_holders(),
            fill_secret=secret,
        )
        result = fill(request)
        termination.filled()  # SIGTERM now ends the stay (below), not the fill
        # [Note: the pod holds its entry] Opening the entry records its last use (eviction
        # goes least recently used first, and the server's own open may be on a read-only
        # mount that cannot record it) and holds `.use` shared: the pod's server maps the
        # entry minutes later, after its imports, and a fill of another model on the node must
        # not evict it in between. The sidecar holds it for the pod's life.
        entry = open_entry(result.root, result.entry_id)
        _write_atomically(Path(args.entry_file), result.entry_document().to_json() + "\n")
    except (Exception, Terminated) as exc:  # every failure becomes the one-line summary
        if entry is not None:
            entry.close()
        if endpoint is not None:
            endpoint.close()
        _report_failure(args, rank, exc)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else 1
    summary = result.summary()
    _finish(args, summary)
    if endpoint is not None:
        endpoint.publish_summary(summary.to_json())
    if args.keep_running:
        _serve_entry(endpoint, entry, settings.loader.peer_serve_bytes_per_second, secret)
        _stay_up(termination.stop)
    entry.close()
    if endpoint is not None:
        endpoint.close()
    return 0


def _yield_cpu() -> None:
    """[Note: the sidecar yields the CPU] The pod's server starts while its loader fills; where
    the node's cores are few, the two compete, and the server's imports and pipeline
    construction (CPU-bound, one thread) are usually what the first request waits for, while the
    fill mostly waits on the network. The scheduler gives a niced process what the others leave,
    so the total work done is the same and the server's start comes first; a fill that is the
    longer path loses only the CPU the server's start takes, which it would share anyway.
    Raising one's own nice value needs no privilege."""
    try:
        os.nice(YIELD_NICE)
    except OSError as exc:
        log.warning("CPU priority not lowered: %s", exc.strerror)


def _stay_up(stop: threading.Event) -> None:
    """A native sidecar's life after its work: idle until the kubelet stops the pod (SIGTERM)
    or a person presses Ctrl-C (either sets `stop`, handled since the command began), then end
    with status 0. An exit before that would be restarted, fill again (finding the entry) and
    count as a restart in `kubectl get pods`."""
    gc.collect()  # what the fill left in reference cycles goes before the long idle
    log.info("entry published; staying up as the pod's sidecar, holding it in use, until "
             "SIGTERM")
    while not stop.wait(3600):
        pass
    log.info("stopping: the pod is shutting down")


def _serve_entry(endpoint: Endpoint | None, entry: EntryHandle, rate: int,
                 secret: bytes | None) -> None:
    """A sidecar that stays up serves the entry it holds to the DOD's loaders refilling other
    nodes (`peer_serve`: to those that hold the DOD's fill `secret`), at most `rate` bytes a
    second; 0, no endpoint or no secret serves nothing."""
    if endpoint is None or rate == 0:
        return
    if secret is None:
        log.info("entry %s not served to peers: no fill secret (%s unset)", entry.entry_id,
                 FILL_SECRET_ENV)
        return
    endpoint.serve_entry(EntryServer(entry, Throttle(rate), metrics.SERVED.inc, secret=secret))
    log.info("serving entry %s to refilling peers on port %d, at most %d bytes/s",
             entry.entry_id, endpoint.port, rate)


def _serve_metrics(port: int, secret: bytes | None) -> Endpoint | None:
    """`/metrics` while the fill runs (the operator's live progress), and the summary to a
    reader that shows the fill `secret`; 0 serves nothing. A port in use costs the metrics,
    never the fill."""
    if port == 0:
        return None
    try:
        endpoint = Endpoint(port, secret=secret)
    except OSError as exc:
        log.warning("metrics endpoint not served: port %d: %s", port, exc.strerror)
        return None
    log.info("serving /metrics on port %d", endpoint.port)
    return endpoint


def load_fill_settings(args: argparse.Namespace) -> Settings:
    """The settings document with this command's flags applied, validated."""
    path = args.config or os.environ.get(CONFIG_ENV)
    settings = load_settings(path) if path else Settings()
    for dest, leaf in OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            settings = replace_path(settings, leaf.path, value)
    return validate(settings)


def preload_transfer_modules() -> threading.Thread:
    """Import what the transfer needs on a thread while this one lists the source: the listing
    waits on the network (and a fresh node reads the image's files from disk), so the two
    overlap. An import that fails here fails again, with its error, where the fill needs it."""
    def load() -> None:
        for name in TRANSFER_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (reported by the fill's own import)
                return

    thread = threading.Thread(target=load, name="dlo-preload", daemon=True)
    thread.start()
    return thread


def _install_log_filters(rank: int, world_size: int) -> None:
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    prefix = RankPrefixFilter(rank, world_size)
    for handler in logging.getLogger().handlers:
        handler.addFilter(prefix)


def _remove_log_filters() -> None:
    for handler in logging.getLogger().handlers:
        for prefix in [f for f in handler.filters if isinstance(f, RankPrefixFilter)]:
            handler.removeFilter(prefix)


def _print_line(line: str) -> None:
    print(line, flush=True)


def _report_failure(args: argparse.Namespace, rank: int | None,
                    exc: Exception | Terminated) -> None:
    message = str(exc)
    if isinstance(exc, DloError | Terminated):
        if getattr(exc, "hint", None):
            message += f" (hint: {exc.hint})"  # type: ignore[union-attr]
        log.error("%s", message, exc_info=getattr(args, "debug", False))
    else:
        message = f"{type(exc).__name__}: {message}"
        log.exception("fill failed unexpectedly")
    _finish(args, FillSummary(status=FillStatus.ERROR, rank=rank, error=" ".join(message.split())))


def _finish(args: argparse.Namespace, summary: FillSummary) -> None:
    line = summary.to_json()
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
