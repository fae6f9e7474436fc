"""The `dlo` command: a table of subcommands, each imported only when it runs.

`dlo --help` must never import torch, boto3 or kopf, so the table names modules as strings. Each
command module provides `add_arguments(parser)` and `run(args) -> int`; one that sets
`EXIT_AT_ONCE = True` ends the process as soon as `run` returns, when `dlo` runs as a command
(its output flushed, no interpreter teardown: the loader's init container exits in milliseconds,
not after garbage-collecting every module). Known errors (`DloError`)
become one line on stderr with a hint; tracebacks only with `--debug`.

Each image installs some of the project's packages (the operator image no loader, no image the
benchmarks), so the table lists only the commands whose package is installed here, found
without importing it; a command whose package is missing says so, and where it comes from.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlo_contract.errors import DloError, PermanentError


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]
    module: str
    summary: str

    @property
    def package(self) -> str:
        """The project package that provides the command (its module's top level)."""
        return self.module.partition(".")[0]


PROVIDED_BY: dict[str, str] = {
    "dlo_cli": "every image",
    "dlo_loader": "the loader image (loader_image/Dockerfile)",
    "dlo_operator": "the operator image (operator/Dockerfile)",
    "dlo_server": "the server image (server/Dockerfile)",
    "dlo_bench": "a checkout of the repository, not with an image: run it there (`make demo`, "
                 "or .venv/bin/dlo once `make test` made .venv)",
}
"""Where each package that provides commands is installed."""


class CommandNotInstalled(PermanentError):
    """A command of the table whose package this environment does not have."""


COMMANDS: tuple[Command, ...] = (
    Command(("demo",), "dlo_bench.demo", "run the whole system on this machine and compare outputs"),
    Command(("cache", "ls"), "dlo_cli.cache_ls", "list the node cache's entries"),
    Command(("cache", "verify"), "dlo_cli.cache_verify", "check an entry (sizes, or --full hashes)"),
    Command(("cache", "gc"), "dlo_cli.cache_gc", "evict least recently used entries"),
    Command(("cache", "fill"), "dlo_loader.cli", "stream a checkpoint from object storage into the cache"),
    Command(("operator", "run"), "dlo_operator.cli", "run the DiffusionOffloadDeployment operator"),
    Command(("node-agent", "run"), "dlo_operator.node_agent", "prepare this node's node-cache directories for the loader"),
    Command(("serve",), "dlo_server.cli", "serve images over HTTP from an offloaded DiT (the reference server)"),
    Command(("render",), "dlo_operator.render", "print the manifests the operator would create"),
    Command(("bench", "runtime"), "dlo_bench.runtime", "hook overhead, step times, host memory"),
    Command(("bench", "serve"), "dlo_bench.serve_bench", "dlo serve's requests/s and p50/p99 latency against a resident pipeline"),
    Command(("bench", "gpu-check"), "dlo_bench.gpu_check", "tests/gpu and the CUDA step-time benchmark (skips without CUDA)"),
    Command(("bench", "loader"), "dlo_bench.loader", "single-node fill against a parallel-GET ceiling"),
    Command(("bench", "cluster"), "dlo_bench.cluster", "simulated multi-node fill with shaped links"),
    Command(("bench", "coldstart"), "dlo_bench.coldstart", "S3 to first forward on one node vs plain and runai"),
)


def installed(commands: Sequence[Command] = COMMANDS) -> tuple[Command, ...]:
    """The commands whose package is installed here; a package is found without importing it
    (nor torch, boto3 or kopf)."""
    packages = {c.package for c in commands}
    present = {p for p in packages if importlib.util.find_spec(p) is not None}
    return tuple(c for c in commands if c.package in present)


def check_installed(argv: Sequence[str], available: Sequence[Command]) -> None:
    """Raise `CommandNotInstalled` when `argv` names a command, or a group of commands, of the
    table that is not installed here."""
    words = tuple(itertools.takewhile(lambda a: not a.startswith("-"), argv))
    if not words or any(c.path[:len(words)] == words[:len(c.path)] for c in available):
        return
    for command in COMMANDS:
        if command.path[:len(words)] == words[:len(command.path)]:
            asked = "dlo " + " ".join(words[:len(command.path)])
            raise CommandNotInstalled(
                f"{asked} is not installed here: its package {command.package} is not in this "
                "environment",
                hint=f"{command.package} comes with {PROVIDED_BY[command.package]}")


def _import(command: Command) -> Any:
    """The command's module; a module it needs that is not installed here (a package of the
    project, or an outside one) becomes `CommandNotInstalled`."""
    try:
        return importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing:
            raise
        where = (PROVIDED_BY[missing] if missing in PROVIDED_BY
                 else "the extra of pyproject.toml that lists it")
        raise CommandNotInstalled(
            f"dlo {' '.join(command.path)} cannot run here: it needs {missing}, which is not "
            "in this environment", hint=f"{missing} comes with {where}") from exc


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlo", description="Distributed Layerwise Offload")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and DEBUG logs")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    }
    for command in commands:
        for depth in range(1, len(command.path)):
            prefix = command.path[:depth]
            if prefix not in groups:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                groups[prefix] = sub.add_subparsers(
                    dest=f"command_{depth}", metavar="COMMAND", required=True
                )
        leaf = groups[command.path[:-1]].add_parser(
            command.path[-1], help=command.summary, description=command.summary, add_help=False
        )
        leaf.set_defaults(_command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    words = [a for a in args_list if a != "--debug"]
    available = installed()
    try:
        check_installed(words, available)
        args, rest = build_parser(available).parse_known_args(words)
        command: Command = args._command
        module = _import(command)
    except CommandNotInstalled as exc:
        if debug:
            raise
        print(f"dlo: error: {exc} (hint: {exc.hint})", file=sys.stderr)
        return 1
    leaf = argparse.ArgumentParser(
        prog="dlo " + " ".join(command.path), description=command.summary
    )
    module.add_arguments(leaf)
    sub_args = leaf.parse_args(rest)
    sub_args.debug = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(module.run(sub_args))
    except DloError as exc:
        if debug:
            raise
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        print(f"dlo: error: {exc}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if argv is None and getattr(module, "EXIT_AT_ONCE", False):
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without interpreter teardown, everything written first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
