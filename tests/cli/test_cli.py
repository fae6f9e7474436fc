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
