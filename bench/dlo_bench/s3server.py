"""S3 servers on loopback for tests, the demo and the benchmarks.

Owns starting and stopping two real S3 implementations as child processes and filling them:
`start_moto` (moto's server: complete S3 semantics, slow ranged reads, for correctness) and
`start_ministack` (ministack: serves ranged reads at memory speed, for throughput figures). Both
return an `S3Server` usable as a context manager; `upload_tree` copies a local directory under a
bucket prefix with boto3 and dummy credentials. Servers bind 127.0.0.1 only and keep their state in
memory. Called by `tests/`, `dlo_bench.demo`, `dlo_bench.loader` and `dlo_bench.cluster`; it must
not be imported by the loader or the runtime.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Self, TypeVar

from dlo_contract.errors import PermanentError
from dlo_contract.source_credentials import AWS_ACCESS_KEY_ID_ENV, AWS_SECRET_ACCESS_KEY_ENV

DUMMY_CREDENTIALS = {
    AWS_ACCESS_KEY_ID_ENV: "testing",
    AWS_SECRET_ACCESS_KEY_ENV: "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Environment for a client of these servers: both accept any key; boto3 needs one to sign."""

_START_TIMEOUT_S = 30.0


_Server = TypeVar("_Server", bound="ServerProcess")


class S3ServerError(PermanentError):
    """A test S3 server did not start or could not be filled."""


@dataclass
class ServerProcess:
    """A running server process on 127.0.0.1; `stop()` (or leaving `with`) ends it and removes
    its scratch directory."""

    endpoint_url: str
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _scratch: Path = field(repr=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._scratch, ignore_errors=True)


@dataclass(kw_only=True)
class S3Server(ServerProcess):
    """A running S3 server process on 127.0.0.1."""

    python: str
    """The version of the Python that serves: how fast ministack sends large bodies depends on
    its asyncio (see the Makefile's `MINISTACK_PYTHON`)."""

    def client(self):  # -> botocore client; typed loosely to keep boto3 out of import time
        """A boto3 S3 client for this server with dummy credentials and path-style addressing."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=DUMMY_CREDENTIALS[AWS_ACCESS_KEY_ID_ENV],
            aws_secret_access_key=DUMMY_CREDENTIALS[AWS_SECRET_ACCESS_KEY_ENV],
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=32),
        )


def free_port() -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto(port: int = 0) -> S3Server:
    """Start moto's S3 server in a child process of this interpreter."""
    port = port or free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return _start("moto", argv, "127.0.0.1", port, {}, python=platform.python_version(),
                  health_path="/moto-api/")


def start_ministack(
    binary: str | os.PathLike[str], port: int = 0, *, host: str = "127.0.0.1"
) -> S3Server:
    """Start ministack (its own virtual environment: it pins botocore) serving only S3.

    ministack reads its port from `GATEWAY_PORT` and its address from `BIND_HOST`, and writes a
    pid file into the temp directory, so each server gets a private `TMPDIR`. `port=0` picks a
    free port on loopback; pass `host` (and a port) to serve on another address.
    """
    path = shutil.which(str(binary)) or str(binary)
    if not Path(path).is_file():
        raise S3ServerError(
            f"ministack executable {binary} not found",
            hint="run `make .venv-ministack/.installed` or pass --ministack PATH",
        )
    port = port or free_port()
    env = {
        "GATEWAY_PORT": str(port),
        "BIND_HOST": host,
        "SERVICES": "s3",
        "LOG_LEVEL": "WARNING",
        "S3_PERSIST": "0",
    }
    argv = [str(Path(path).resolve())]
    return _start("ministack", argv, host, port, env, python=_script_python(path),
                  health_path="/_ministack/health")


def _script_python(script: str | os.PathLike[str]) -> str:
    """The Python version that runs an installed script (the interpreter its `#!` line names)."""
    with open(shutil.which(str(script)) or script, "rb") as handle:
        first = handle.readline()
    interpreter = first[2:].split()[0].decode() if first.startswith(b"#!") else sys.executable
    found = subprocess.run([interpreter, "-c", "import platform; print(platform.python_version())"],
                           capture_output=True, text=True, check=False)
    return found.stdout.strip() or "unknown"


def _start(
    name: str, argv: list[str], host: str, port: int, env: dict[str, str], *, python: str,
    health_path: str
) -> S3Server:
    record = functools.partial(S3Server, endpoint_url=f"http://{host}:{port}", name=name,
                               python=python)
    return start_process(name, argv, env, health_path, record)


def start_process(name: str, argv: list[str], env: dict[str, str], health_path: str,
                  record: Callable[..., _Server]) -> _Server:
    """Start `argv` in a scratch directory (its `TMPDIR` too) and wait until it answers
    `health_path`; `record(process=, log_path=, _scratch=)` makes its `ServerProcess`."""
    scratch = Path(tempfile.mkdtemp(prefix=f"dlo-{name}-"))
    log_path = scratch / "server.log"
    child_env = {**os.environ, **env, "TMPDIR": str(scratch)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=scratch
        )
    server = record(process=process, log_path=log_path, _scratch=scratch)
    try:
        _wait_ready(server, health_path)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: ServerProcess, health_path: str) -> None:
    """Poll until `server` answers HTTP at all; a dead process fails at once with its log."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise S3ServerError(f"{server.name} exited with {server.process.returncode}: {tail}")
        try:
            with urllib.request.urlopen(server.endpoint_url + health_path, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise S3ServerError(f"{server.name} did not answer on {server.endpoint_url} within "
                        f"{_START_TIMEOUT_S:.0f} s")


def upload_tree(
    server: S3Server, bucket: str, prefix: str, local_dir: str | os.PathLike[str]
) -> list[str]:
    """Create `bucket` if needed and upload every file under `local_dir` to `prefix/<relpath>`.

    Returns the uploaded keys, sorted. Single-part uploads keep ETags equal to the MD5 of the
    content, which makes the source identity predictable in tests.
    """
    client = server.client()
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    root = Path(local_dir)
    keys = []
    base = prefix.strip("/")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        key = f"{base}/{rel}" if base else rel
        with path.open("rb") as body:
            client.put_object(Bucket=bucket, Key=key, Body=body)
        keys.append(key)
    return keys
