"""The `dlo` command table: lazy imports, complete table, one-line errors."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from dlo_cli import main as cli


def test_help_lists_every_top_level_command(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in {c.path[0] for c in cli.COMMANDS}:
        assert name in out


def help_without_planes(*argv: str) -> str:
    """`dlo ARGV --help`'s output in a process where torch, boto3 and kopf cannot import."""
    code = (
        "import sys\n"
        "for name in ('torch', 'boto3', 'kopf', 'kubernetes'): sys.modules[name] = None\n"
        "from dlo_cli import main as cli\n"
        "try:\n"
        f"    cli.main({[*argv, '--help']!r})\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "exit 0" in out.stdout
    return out.stdout


def test_help_imports_no_plane() -> None:
    out = help_without_planes("cache")
    for leaf in ("ls", "verify", "gc", "fill"):
        assert leaf in out


def test_serve_help_lists_its_options_without_importing_torch() -> None:
    out = help_without_planes("serve")
    for option in ("--port", "--ranks", "--queue-size", "--max-n", "--max-steps", "--max-side",
                   "--model", "--threads"):
        assert option in out
    assert "--master-port" not in out  # the ranks' own flags stay hidden


@pytest.mark.parametrize("command", cli.COMMANDS, ids=lambda c: " ".join(c.path))
def test_every_command_module_provides_the_protocol(command: cli.Command) -> None:
    module = importlib.import_module(command.module)
    assert callable(module.add_arguments)
    assert callable(module.run)


def test_known_error_is_one_line_with_hint(tmp_path, capsys) -> None:
    code = cli.main(["cache", "verify", "0123abcd", "--root", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"dlo: error: cache entry 0123abcd not found in {tmp_path} "
        f"(hint: list entries with: dlo cache ls --root {tmp_path})"
    ]


def test_debug_shows_the_traceback(tmp_path) -> None:
    from dlo_contract.cache import CacheError

    with pytest.raises(CacheError):
        cli.main(["cache", "verify", "0123abcd", "--root", str(tmp_path), "--debug"])


def dlo_without(packages: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    """`dlo ARGV` in a process where the project's `packages` cannot be found or imported, as
    in an image that does not install them."""
    code = (
        "import sys\n"
        f"for name in {packages!r}: sys.modules[name] = None\n"
        "from dlo_cli import main as cli\n"
        f"sys.exit(cli.main({list(argv)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def listed(help_text: str) -> list[str]:
    """The command names a `--help` lists, in order."""
    return [line.split()[0] for line in help_text.splitlines()
            if line.startswith("    ") and line[4] not in " -"]


OPERATOR_IMAGE_LACKS = ("dlo_bench", "dlo_loader", "dlo_runtime", "dlo_server")
BENCH_HINT = ("dlo_bench comes with a checkout of the repository, not with an image: run it "
              "there (`make demo`, or .venv/bin/dlo once `make test` made .venv)")


def test_an_image_lists_only_the_commands_its_packages_provide() -> None:
    top = dlo_without(OPERATOR_IMAGE_LACKS, "--help")
    assert top.returncode == 0, top.stderr
    assert listed(top.stdout) == ["cache", "operator", "node-agent", "render"]
    cache = dlo_without(OPERATOR_IMAGE_LACKS, "cache", "--help")
    assert listed(cache.stdout) == ["ls", "verify", "gc"]
    everything = dlo_without((), "--help")
    assert listed(everything.stdout) == ["demo", "cache", "operator", "node-agent", "serve",
                                         "render", "bench"]


@pytest.mark.parametrize("argv, asked", [
    (("bench", "loader", "--json"), "dlo bench loader"),
    (("bench", "--help"), "dlo bench"),
    (("demo",), "dlo demo"),
])
def test_a_benchmark_in_an_image_says_it_is_not_installed(argv: tuple[str, ...],
                                                          asked: str) -> None:
    done = dlo_without(OPERATOR_IMAGE_LACKS, *argv)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"dlo: error: {asked} is not installed here: its package dlo_bench is not in this "
        f"environment (hint: {BENCH_HINT})"]


def test_a_fill_in_the_operator_image_names_the_loader_image() -> None:
    done = dlo_without(OPERATOR_IMAGE_LACKS, "cache", "fill", "--source", "s3://b/m/")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "dlo: error: dlo cache fill is not installed here: its package dlo_loader is not in "
        "this environment (hint: dlo_loader comes with the loader image "
        "(loader_image/Dockerfile))"]


def test_a_command_whose_module_needs_a_missing_package_says_which() -> None:
    done = dlo_without(("dlo_loader",), "bench", "loader", "--json")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "dlo: error: dlo bench loader cannot run here: it needs dlo_loader, which is not in "
        "this environment (hint: dlo_loader comes with the loader image "
        "(loader_image/Dockerfile))"]
