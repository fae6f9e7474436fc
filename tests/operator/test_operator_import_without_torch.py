"""The operator image has no torch: every operator module must import without it."""

from __future__ import annotations

import subprocess
import sys

MODULES = ("dlo_operator.handlers", "dlo_operator.cli", "dlo_operator.render",
           "dlo_operator.kube", "dlo_operator.status", "dlo_operator.node_agent")


def test_operator_imports_with_torch_and_boto3_blocked() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'boto3', 'botocore', 'numpy', 'safetensors', 'diffusers'):\n"
        "    sys.modules[name] = None\n"
        f"import importlib\nfor m in {MODULES!r}:\n    importlib.import_module(m)\n"
        "from dlo_operator.render import render_file\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr


def test_the_builders_import_without_kopf_or_the_kubernetes_client() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'kopf', 'kubernetes'):\n"
        "    sys.modules[name] = None\n"
        "import dlo_operator.render, dlo_operator.status, dlo_operator.node_directories\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr
