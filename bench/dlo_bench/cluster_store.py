"""The object-store side of `dlo bench cluster`, run inside the store namespace.

`python -m dlo_bench.cluster_store --ministack BIN --host ADDR --port P --bucket B --prefix K DIR`
starts ministack bound to the store namespace's address (not loopback, so that the node
namespaces reach it), uploads DIR under `s3://B/K/`, prints one JSON line
`{"endpoint_url", "keys", "bytes"}`, then serves until its standard input closes and stops the
server. Tying the server's life to a pipe from `dlo_bench.cluster` means a benchmark that dies
for any reason never leaves a server behind in a deleted namespace. It must not shape traffic or
create namespaces (`dlo_bench.netns` does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from dlo_bench.s3server import S3Server, S3ServerError, upload_tree

_START_TIMEOUT_S = 30.0


def _start(binary: str, host: str, port: int) -> S3Server:
    """ministack on host:port serving S3 only, state in memory, scratch in a private TMPDIR."""
    scratch = Path(tempfile.mkdtemp(prefix="dlo-cluster-store-"))
    log_path = scratch / "server.log"
    env = {**os.environ, "GATEWAY_PORT": str(port), "BIND_HOST": host, "SERVICES": "s3",
           "LOG_LEVEL": "WARNING", "S3_PERSIST": "0", "TMPDIR": str(scratch)}
    try:
        with log_path.open("wb") as log:
            process = subprocess.Popen([binary], stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=scratch)
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise S3ServerError(f"cannot start ministack {binary}: {exc}") from exc
    return S3Server(endpoint_url=f"http://{host}:{port}", name="ministack", process=process,
                    log_path=log_path, _scratch=scratch)


def _wait_ready(server: S3Server) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise S3ServerError(f"ministack exited with {server.process.returncode}: {tail}")
        try:
            with urllib.request.urlopen(server.endpoint_url + "/_ministack/health", timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise S3ServerError(f"ministack did not answer on {server.endpoint_url} within "
                        f"{_START_TIMEOUT_S:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlo_bench.cluster_store")
    parser.add_argument("--ministack", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    binary = shutil.which(args.ministack) or args.ministack
    server = _start(binary, args.host, args.port)
    try:
        _wait_ready(server)
        keys = upload_tree(server, args.bucket, args.prefix, args.directory)
        size = sum(p.stat().st_size for p in args.directory.rglob("*") if p.is_file())
        print(json.dumps({"endpoint_url": server.endpoint_url, "keys": keys, "bytes": size}),
              flush=True)
        sys.stdin.read()  # serve until the benchmark closes the pipe (or dies)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
