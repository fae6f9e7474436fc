"""The last step of `dlo demo`: one image through the real HTTP path.

Starts `dlo serve` (two data-parallel ranks in AllGather mode over node0's entry, the settings
the runtime step used) as a child of the demo, waits for its readiness probe, asks
`POST /v1/images/generations` for one image, writes the PNG to the path the user named, and
stops the server with SIGTERM as the kubelet would (it must exit 0). Called by
`dlo_bench.demo`; the server's process group is the demo's `Children` to stop on any failure.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dlo_bench.demo_processes import Child, Children, DemoError
from dlo_bench.s3server import free_port

PROMPT = "a lighthouse at dusk"
SIZE = 64
_POLL_S = 0.2


def serve_one_image(children: Children, *, ranks: int, env: dict[str, str], steps: int,
                    seed: int, image: Path, timeout_s: float) -> dict[str, Any]:
    """Start the server, get one image, save it, stop the server; the step's figures."""
    started = time.monotonic()
    server, url = start_server(children, "server", ranks=ranks, env=env)
    wait_ready(server, url, timeout_s)
    ready_s = time.monotonic() - started
    request = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "num_inference_steps": steps,
               "seed": seed, "response_format": "b64_json"}
    asked = time.monotonic()
    body = post_json(f"{url}/v1/images/generations", request, timeout_s)
    png = base64.b64decode(body["data"][0]["b64_json"])
    latency_s = time.monotonic() - asked
    image.parent.mkdir(parents=True, exist_ok=True)
    image.write_bytes(png)
    server.process.terminate()
    try:
        code = server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"serve: the server did not stop within {timeout_s:g} s of SIGTERM"
                        ) from exc
    if code != 0:
        raise DemoError(f"serve: the server exited with status {code} after SIGTERM:\n"
                        f"{server.stderr_tail()}")
    return {"ranks": ranks, "image": str(image), "size": _png_size(png), "bytes": len(png),
            "steps": steps, "ready_s": round(ready_s, 1), "latency_s": round(latency_s, 2)}


def start_server(children: Children, name: str, *, ranks: int, env: dict[str, str]
                 ) -> tuple[Child, str]:
    """`dlo serve` on a free loopback port, one CPU thread per rank; the child and its URL."""
    port = free_port()
    server = children.start(name, [
        sys.executable, "-m", "dlo_cli.main", "serve", "--host", "127.0.0.1", "--port",
        str(port), "--ranks", str(ranks), "--threads", "1"], env=env)
    return server, f"http://127.0.0.1:{port}"


def wait_ready(server: Any, url: str, timeout_s: float) -> None:
    """Poll the readiness probe of the server `server` (a `Child`) until it passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health/ready", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if server.process.poll() is not None:
            raise DemoError(f"serve: the server exited with status {server.process.returncode} "
                            f"before it was ready:\n{server.stderr_tail()}")
        if time.monotonic() > deadline:
            raise DemoError(f"serve: the server was not ready after {timeout_s:g} s",
                            hint="rerun with --keep and read logs/server.err")
        time.sleep(_POLL_S)


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST `body` as JSON; the decoded answer, or `DemoError` with the server's error."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise DemoError(f"serve: POST {url} answered {exc.code}: "
                        f"{exc.read().decode(errors='replace')}") from exc


def _png_size(png: bytes) -> list[int]:
    from PIL import Image

    return list(Image.open(io.BytesIO(png)).size)
