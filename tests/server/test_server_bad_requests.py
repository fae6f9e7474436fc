"""Whatever a request holds, it fails alone, against a real two-rank `dlo serve` in each mode,
driven by clients the server's authors did not write: the official `openai` client, `requests`
and raw sockets. Every bad input gets a 400 (413 for an over-size body) in the API's error shape
naming its field, while a wave runs; the probes say ready throughout; the request in flight gets
its images; each answer is counted; SIGTERM during a wave exits 0. A client that goes away has its
queued images dropped: counted as made images, never by time."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import openai
import psutil
import pytest
from support.scrape import scrape, value
from support.server_helpers import RunningServer, pod_files, start_server
from test_server_lifecycle import wait_for

pytestmark = pytest.mark.slow

GENERATIONS = "/v1/images/generations"
MODES = pytest.mark.parametrize("allgather", [True, False], ids=["allgather", "rank-local"])
BAD_JSON = [  # (body as JSON, the field the 400 names)
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "a\x00b"}, "prompt"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({"prompt": "x", "size": "\u00b2x\u00b2"}, "size"),
    ({"prompt": "x", "size": "\u0663\u0662x\u0663\u0662"}, "size"),
    ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": float("-inf")}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": 10**400}, "guidance_scale"),
]


def client(server: RunningServer) -> openai.OpenAI:
    """The official client; it retries nothing, so each call is one request."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def generate(server: RunningServer, prompt: str, n: int, steps: int, seed: int,
             size: str = "32x32") -> list[str]:
    """Images through `openai.OpenAI().images.generate`, as base64 PNGs."""
    answer = client(server).images.generate(
        model="dlo", prompt=prompt, n=n, size=size, response_format="b64_json",
        extra_body={"num_inference_steps": steps, "seed": seed})
    return [image.b64_json for image in answer.data]


def raw(server: RunningServer, body: bytes, *, length: int | None = None) -> tuple[int, dict]:
    """POST `body` over a bare socket (Content-Length `length`, default its size); the status
    and the JSON answer."""
    head = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body) if length is None else length}\r\n"
            "Connection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(head)
        try:
            sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):  # refused before it was all read
            pass
        answer = _read_all(sock)
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def ready(server: RunningServer) -> tuple[int, str]:
    answer = server.get("/health/ready")
    return answer.status_code, answer.json()["state"]


def forwards(server: RunningServer) -> float:
    return value(scrape(server.port), "dlo_runtime_forwards_total", component="transformer")


def refusals(server: RunningServer) -> list[tuple[int, str | None]]:
    """Each bad input, sent by the client that can send it; its status and `error.param`."""
    out = []
    for body, field in BAD_JSON:
        if isinstance(body.get("guidance_scale"), float) or body["prompt"] != "x":
            status, answer = raw(server, json.dumps(body).encode())  # NaN, -Infinity as JSON
            out.append((status, answer["error"]["param"]))
        else:
            try:
                client(server).images.generate(prompt="x", extra_body=body)
            except openai.BadRequestError as error:
                out.append((error.status_code, error.param))
        assert ready(server) == (200, "ready")
    nested = b"[" * 10_000 + b"]" * 10_000
    for body, length in [(nested, None), (b'{"prompt": "' + b"x" * 1_000_000 + b'"}', None),
                         (b"{}", 2**31)]:
        status, answer = raw(server, body, length=length)
        out.append((status, answer["error"]["param"]))
        assert ready(server) == (200, "ready")
    return out


EXPECTED = [(400, field) for _, field in BAD_JSON] + [(400, "body"), (413, "body"),
                                                       (413, "body")]


def occupy(pool: ThreadPoolExecutor, server: RunningServer, prompt: str, seed: int,
           allgather: bool) -> list[Future]:
    """Requests that keep rank 0 making forwards (its `dlo_runtime_*` series are the ones
    scraped): one of two images in AllGather mode (rank 1 runs the same calls idle); one image
    per rank in rank-local mode, where either rank may take a request."""
    count = 1 if allgather else 2
    return [pool.submit(generate, server, prompt, 2 // count, 12, seed + index, "64x64")
            for index in range(count)]


@MODES
def test_bad_requests_get_400_naming_the_field_while_a_wave_runs(
        tmp_path: Path, servers: list[RunningServer], allgather: bool) -> None:
    server = start_server(pod_files(tmp_path, ranks=2, allgather=allgather),
                          tmp_path / "server.log", "--stop-timeout", "600")
    servers.append(server)
    server.wait_ready()
    with ThreadPoolExecutor(2) as pool:
        in_flight = occupy(pool, server, "a lighthouse", 1, allgather)
        wait_for(lambda: forwards(server) >= 1)
        assert refusals(server) == EXPECTED
        assert all(len(answer.result()) == 2 // len(in_flight) for answer in in_flight)
        samples = scrape(server.port)
        assert value(samples, "dlo_server_request_seconds_count", outcome="invalid") == len(
            EXPECTED)
        assert value(samples, "dlo_server_request_seconds_count", outcome="ok") == len(
            in_flight)
        last = occupy(pool, server, "a boat", 3, allgather)
        before = forwards(server)
        wait_for(lambda: forwards(server) > before)  # SIGTERM while its wave runs
        assert server.stop() == 0, server.log_tail()
        assert all(len(answer.result()) == 2 // len(last) for answer in last)
    assert "stopped cleanly" in server.log_tail()


@contextmanager
def rank1_stopped(server: RunningServer) -> Iterator[None]:
    """Rank 1 stopped (SIGSTOP) until the block ends: an AllGather wave waits for it, and in
    rank-local mode the image sent to it does."""
    [rank1] = [child for child in psutil.Process(server.process.pid).children()
               if "--rank" in child.cmdline()]
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):  # killed by the server meanwhile
            os.kill(rank1.pid, signal.SIGCONT)


def held(server: RunningServer) -> tuple[float, float]:
    """(requests accepted and not answered, images queued)."""
    samples = scrape(server.port)
    return (value(samples, "dlo_server_requests_in_flight"),
            value(samples, "dlo_server_queue_depth"))


def send_and_leave_open(server: RunningServer, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body)
    sock.sendall(f"POST {GENERATIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode())
    return sock


@MODES
def test_an_abandoned_requests_queued_images_are_not_made(
        tmp_path: Path, servers: list[RunningServer], allgather: bool) -> None:
    """Every rank busy (rank 1 stopped; in rank-local mode rank 0 makes 50 steps at 256x256),
    one more request queued, its client gone: its image is never made."""
    server = start_server(pod_files(tmp_path, ranks=2, allgather=allgather),
                          tmp_path / "server.log")
    servers.append(server)
    server.wait_ready()
    busy = 1 if allgather else 2  # requests that hold every rank: one wave, or one per rank
    with ThreadPoolExecutor(busy) as pool, rank1_stopped(server):
        first = []
        for index in range(busy):
            first.append(pool.submit(generate, server, f"busy {index}", 1, 50, index,
                                     "256x256"))
            wait_for(lambda count=index + 1: held(server) == (count, 0))  # taken, not queued
        with send_and_leave_open(server, {"prompt": "gone", "size": "128x128", "seed": 9}):
            wait_for(lambda: held(server) == (busy + 1, 1))
        wait_for(lambda: held(server) == (busy, 0))  # its client went away: its image dropped
    assert all(len(answer.result()) == 1 for answer in first)
    assert len(generate(server, "after", 1, 2, 3)) == 1
    samples = scrape(server.port)
    assert value(samples, "dlo_server_images_total") == busy + 1
    assert value(samples, "dlo_server_request_seconds_count", outcome="abandoned") == 1
    assert value(samples, "dlo_server_request_seconds_count", outcome="ok") == busy + 1
    assert server.stop() == 0, server.log_tail()


def test_sigterm_with_a_wave_that_cannot_end_exits_within_the_stop_timeout(
        tmp_path: Path, servers: list[RunningServer]) -> None:
    """A rank stopped mid-wave (SIGSTOP): the wave never ends, yet SIGTERM stops the server
    (exit 1, the ranks killed) instead of waiting out the group's timeouts."""
    server = start_server(pod_files(tmp_path, ranks=2), tmp_path / "server.log",
                          "--stop-timeout", "1")
    servers.append(server)
    server.wait_ready()
    with ThreadPoolExecutor(2) as pool, rank1_stopped(server):
        stuck = pool.submit(generate, server, "stuck", 1, 2, 1)
        wait_for(lambda: held(server) == (1, 0))  # in a wave that waits for rank 1
        queued = pool.submit(server.generate, {"prompt": "queued", "size": "16x16"})
        wait_for(lambda: held(server) == (2, 1))
        assert server.stop() == 1, server.log_tail()
        answer = queued.result()
        assert (answer.status_code, answer.json()["error"]["type"]) == (
            503, "server_unavailable")
        with pytest.raises(openai.APIConnectionError):
            stuck.result()
    assert "did not finish within --stop-timeout 1 s" in server.log_tail()
