"""`dlo serve` as the server tests start it: a tiny random-weight Flux model folder published
into a scratch node cache (as the loader would), the pod's documents, the server as a real
process (in a session of its own, so that a test can stop every rank it started), and the
resident reference a served image must equal."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests
from dlo_bench.entries import publish_layout
from dlo_bench.s3server import free_port
from dlo_bench.serve_model import Family, save_pipeline
from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV, ENTRY_WAIT_ENV
from dlo_contract.settings import CacheConfig, OffloadConfig, ParallelConfig, Settings
from dlo_contract.validation import validate

SOURCE = "s3://models/flux-tiny/"
READY_TIMEOUT_S = 120


@dataclass(frozen=True)
class PodFiles:
    """What a pod's server reads: the settings document, the entry file (once published)."""

    model: Path
    cache: Path
    settings: Path
    entry_file: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, CONFIG_ENV: str(self.settings), ENTRY_FILE_ENV: str(self.entry_file),
                "OMP_NUM_THREADS": "1", **extra}

    def publish(self) -> None:
        """What the loader does at the end of its fill: publish the entry, write the file."""
        entry = publish_layout(self.cache, self.model, SOURCE)
        self.entry_file.write_text(entry.to_json())


def pod_files(directory: Path, *, ranks: int, allgather: bool = True,
              publish: bool = True, family: Family = Family.FLUX, **offload: Any) -> PodFiles:
    """A tiny `family` pipeline published for a pod of `ranks`; `offload`: more fields of the
    settings' `OffloadConfig`."""
    model = save_pipeline(family, directory / "model")
    settings = Settings(offload=OffloadConfig(enabled=True, use_allgather=allgather, **offload),
                        parallel=ParallelConfig(dp=ranks),
                        cache=CacheConfig(root=str(directory / "cache")))
    files = PodFiles(model, directory / "cache", directory / "settings.json",
                     directory / "entry.json")
    files.settings.write_text(validate(settings).to_json())
    if publish:
        files.publish()
    return files


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, timeout=30)

    def generate(self, body: dict[str, Any], timeout_s: float = 300) -> requests.Response:
        return requests.post(self.url + "/v1/images/generations", json=body, timeout=timeout_s)

    def video(self, body: dict[str, Any], timeout_s: float = 300) -> tuple[np.ndarray, bytes]:
        """A video job's frames (uint8) and MP4, once completed (polled: a hang guard)."""
        created = requests.post(self.url + "/v1/videos", json=body, timeout=30)
        assert created.status_code == 200, created.text
        path = f"/v1/videos/{created.json()['id']}"
        deadline = time.monotonic() + timeout_s
        while (status := self.get(path).json())["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"video not made:\n{self.log_tail()}"
            time.sleep(0.2)
        assert status["status"] == "completed", status
        frames = np.load(io.BytesIO(self.get(path + "/content?variant=frames").content))
        return frames, self.get(path + "/content").content

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll readiness (a hang guard, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.get("/health/ready").status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server not ready:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM to rank 0 (what the kubelet sends); its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=120)

    def kill_all(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        else:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # ranks left behind, if any
            except ProcessLookupError:
                pass


def start_server(files: PodFiles, log: Path, *args: str, **env: str) -> RunningServer:
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlo_cli.main", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--threads", "1", *args], env=files.env(**env), stdout=out,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return RunningServer(process, port, log)


def png_of(response: requests.Response) -> list[bytes]:
    assert response.status_code == 200, response.text
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


def references(files: PodFiles, jobs: list[dict[str, Any]], out: Path) -> list[list[Any]]:
    """Each job's outputs from the folder's diffusers pipeline called directly, with a resident
    transformer, in one process with one thread: its PNGs, or its videos' uint8 frames."""
    out.write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-m", "support.server_reference", str(files.model),
                           str(out)], env=files.env(PYTHONPATH=os.pathsep.join(sys.path)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [[base64.b64decode(item) if isinstance(item, str) else item for item in outputs]
            for outputs in json.loads(out.read_text())]


__all__ = ["ENTRY_WAIT_ENV", "PodFiles", "RunningServer", "free_port", "pod_files", "png_of",
           "references", "start_server"]
