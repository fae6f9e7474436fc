"""`dlo serve --help`: the options, without importing torch (the command table's rule)."""

from __future__ import annotations

import subprocess
import sys


def test_serve_help_lists_the_options_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from dlo_cli import main as cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "exit 0" in out.stdout
    for option in ("--port", "--ranks", "--queue-size", "--max-n", "--max-steps", "--max-side",
                   "--model", "--threads"):
        assert option in out.stdout
    assert "--master-port" not in out.stdout  # the ranks' own flags stay hidden
