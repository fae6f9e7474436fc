"""Live fill progress: the running loaders' metrics endpoints turned into `status.progress`.

While a loader fills, the operator reads `http://<podIP>:<loader.metricsPort>/metrics`
(no API token in workload pods; the loader serves its `Progress`, see `dlo_loader.metrics`) and
writes per-node bytes done / total, throughput and ETA (or `stalled`), when it last saw the loader
progress (`progressAt`: `prefill_watch` reports a prefill loader without progress), plus a
one-line summary for the PROGRESS printer column. When no loader runs the field is removed: the termination message
(the fill summary in `status.nodes`) holds the final figures; a sidecar loader that published
stays up, so its summary is read once from its endpoint and kept on its pod
(`published_without_summary`, `read_summary`), with the Events its figures call for
(`fill_report`). `read_loader` and `read_summary` do the HTTP;
`progress_status` is pure. Called by the handlers' timer; must not patch anything itself.

[Note: reading a tenant's pod] The address read is a pod's, and whoever runs the pod decides
what answers there. So a read has a total deadline (`READ_DEADLINE_S`, from the connect to the
last byte: a reply trickled a few bytes at a time is cut there, not kept alive by each read's
own timeout), a size cap (`MAX_REPLY_BYTES`: past it the reply is dropped), and follows no
redirect (a `3xx` is no reading: the operator asks no other address than the pod's). The
summary, which names the entry, the source and the group's pods and nodes, is asked for with
proof of the DOD's fill secret (`dlo_contract.fill_proof`), which the proof does not reveal. The
handlers run these reads off kopf's shared pool (see `handlers.loader_progress`).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import io
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dlo_contract.documents import DocumentError, FillSummary
from dlo_contract.names import LOADER_PROOF_HEADER, LOADER_SUMMARY_PATH
from dlo_contract.units import human_bytes, human_eta
from dlo_operator import metrics
from dlo_operator.naming import ANNOTATION_FILL_SUMMARY, LOADER_CONTAINER

log = logging.getLogger(__name__)

READ_DEADLINE_S = 2.0
"""Seconds one read of a loader may take in all, from its connect to its last byte."""
MAX_REPLY_BYTES = 1 << 20
"""The most a loader's reply may hold (its metrics are a few KiB, its summary less)."""
INTERVAL_S = 5.0
"""How often the operator reads the running loaders (the PROGRESS column's refresh)."""


@dataclass(frozen=True, kw_only=True)
class LoaderReading:
    """One scrape of one loader's endpoint."""

    bytes_done: int
    bytes_total: int
    bytes_per_second: float
    stalled: bool
    phase: str


def running_loaders(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods whose loader is filling and which have an IP to reach it on: a workload pod's
    sidecar running and not yet ready (once it published it stays up, ready), a prefill Job
    pod's loader container running (it has no readiness probe and ends with its fill)."""
    return [pod for pod in pods if (pod.get("status") or {}).get("podIP") and (
        _running(sidecar := _loader(pod, "initContainerStatuses")) and not sidecar.get("ready")
        or _running(_loader(pod, "containerStatuses")))]


def published_without_summary(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods whose sidecar loader published (running and ready) and whose fill summary the
    operator has not copied yet (`naming.ANNOTATION_FILL_SUMMARY`)."""
    return [pod for pod in pods if (pod.get("status") or {}).get("podIP")
            and ANNOTATION_FILL_SUMMARY not in ((pod.get("metadata") or {}).get("annotations")
                                                or {})
            and _running(sidecar := _loader(pod, "initContainerStatuses"))
            and sidecar.get("ready")]


def _loader(pod: Mapping[str, Any], statuses: str) -> Mapping[str, Any]:
    """The loader's container status among the pod's `statuses` (empty when absent)."""
    return next((c for c in (pod.get("status") or {}).get(statuses) or ()
                 if c.get("name") == LOADER_CONTAINER), {})


def _running(container: Mapping[str, Any]) -> bool:
    return "running" in (container.get("state") or {})


def read_summary(address: str, port: int, proof: str,
                 deadline_s: float = READ_DEADLINE_S) -> str | None:
    """One published loader's fill summary line (`names.LOADER_SUMMARY_PATH`), asked for with
    `proof` of the DOD's fill secret; None when it does not answer or is not a summary."""
    line = (_get(address, port, LOADER_SUMMARY_PATH, deadline_s,
                 {LOADER_PROOF_HEADER: proof}) or "").strip()
    try:
        FillSummary.from_json(line)
    except DocumentError as exc:
        log.debug("loader summary at %s:%d not usable: %s", address, port, exc)
        return None
    return line


def read_summaries(pods: Sequence[Mapping[str, Any]], port: int, proof: str
                   ) -> list[tuple[Mapping[str, Any], str]]:
    """Every pod's summary (`read_summary`) read in parallel: one read's deadline for all."""
    if not pods:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(pods), 16)) as pool:
        lines = list(pool.map(lambda pod: read_summary(pod["status"]["podIP"], port, proof),
                              pods))
    return [(pod, line) for pod, line in zip(pods, lines) if line is not None]


def _get(address: str, port: int, path: str, deadline_s: float,
         headers: Mapping[str, str] | None = None) -> str | None:
    """The body of a `200` answer to `GET http://address:port/path`, or None when the loader
    does not answer one within `deadline_s` in all, answers another status (a redirect too),
    or sends more than `MAX_REPLY_BYTES` (see [Note: reading a tenant's pod]). Nothing of the
    reply, nor `headers` (a proof), reaches the log."""
    deadline = time.monotonic() + deadline_s
    host = f"[{address}]" if ":" in address else address
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    try:
        with socket.create_connection((address, port), timeout=deadline_s) as sock:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            raw = _read_until_closed(sock, deadline)
        reply = http.client.HTTPResponse(_Received(raw))  # type: ignore[arg-type]
        reply.begin()
        if reply.status != 200:
            log.debug("loader %s at %s:%d answered %d", path, address, port, reply.status)
            return None
        return reply.read().decode()
    except (OSError, http.client.HTTPException, UnicodeDecodeError, _TooLarge) as exc:
        log.debug("loader %s at %s:%d not readable: %s", path, address, port,
                  type(exc).__name__)
        return None


class _TooLarge(Exception):
    """A reply past `MAX_REPLY_BYTES`."""


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """What the peer sends until it closes, by `deadline` (else `TimeoutError`), at most
    `MAX_REPLY_BYTES` and a head (else `_TooLarge`)."""
    received = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply did not end by the read's deadline")
        sock.settimeout(left)  # each receive waits only for what is left of the deadline
        piece = sock.recv(64 << 10)
        if not piece:
            return bytes(received)
        received += piece
        if len(received) > MAX_REPLY_BYTES + (16 << 10):
            raise _TooLarge(f"more than {MAX_REPLY_BYTES} bytes")


class _Received:
    """A reply read whole, as `http.client.HTTPResponse` reads a socket."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self._raw)


def read_all(pods: Sequence[Mapping[str, Any]], port: int
             ) -> list[tuple[Mapping[str, Any], LoaderReading]]:
    """Read every pod's loader in parallel; the ones that do not answer are left out."""
    if not pods:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(pods), 16)) as pool:
        readings = list(pool.map(lambda pod: read_loader(pod["status"]["podIP"], port), pods))
    for reading in readings:
        metrics.PROGRESS_READS.labels(outcome="ok" if reading else "unreachable").inc()
    return [(pod, reading) for pod, reading in zip(pods, readings) if reading is not None]


def read_loader(address: str, port: int,
                deadline_s: float = READ_DEADLINE_S) -> LoaderReading | None:
    """Scrape one loader; None when it does not answer (not serving yet, or just finished)."""
    text = _get(address, port, "/metrics", deadline_s)
    if text is None:
        return None
    values: dict[str, float] = {}
    phase = ""
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "dlo_loader_phase":
                    if sample.value == 1:
                        phase = sample.labels.get("phase", "")
                else:
                    values[sample.name] = sample.value
    except ValueError:  # not the exposition format: whatever answers there is no loader
        log.debug("loader metrics at %s:%d do not parse", address, port)
        return None
    if "dlo_loader_bytes_total_bytes" not in values:
        return None
    return LoaderReading(
        bytes_done=int(values.get("dlo_loader_bytes_done_bytes", 0)),
        bytes_total=int(values["dlo_loader_bytes_total_bytes"]),
        bytes_per_second=values.get("dlo_loader_throughput_bytes_per_second", 0.0),
        stalled=values.get("dlo_loader_stalled", 0) == 1, phase=phase)


def progress_status(readings: Sequence[tuple[Mapping[str, Any], LoaderReading]], *,
                    previous: Mapping[str, Any] | None = None, now: str = "",
                    running: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any] | None:
    """`status.progress` from (pod, reading) pairs; None (remove the field) when there are none.
    Each node's `progressAt` is `now` unless the `previous` progress shows its pod with the same
    bytes written and phase (no progress since): then it stays. A pod of `running` (loaders
    still filling) whose endpoint did not answer this time keeps its previous row, so a hung
    loader that stops answering keeps the time it last moved."""
    before = {n.get("pod"): n for n in (previous or {}).get("nodes") or ()}
    answered = {(pod.get("metadata") or {}).get("name", "") for pod, _ in readings}
    kept = [dict(before[name]) for pod in running
            if (name := (pod.get("metadata") or {}).get("name", "")) not in answered
            and name in before]
    if not readings and not kept:
        return None
    nodes = kept
    for pod, reading in readings:
        name = (pod.get("metadata") or {}).get("name", "")
        node: dict[str, Any] = {
            "pod": name, "node": (pod.get("spec") or {}).get("nodeName", ""),
            "bytesDone": reading.bytes_done, "bytesTotal": reading.bytes_total,
            "bytesPerSecond": int(reading.bytes_per_second), "stalled": reading.stalled,
            "phase": reading.phase,
        }
        last = before.get(name) or {}
        same = (last.get("bytesDone"), last.get("phase")) == (reading.bytes_done, reading.phase)
        progress_at = last.get("progressAt") if same and last.get("progressAt") else now
        if progress_at:
            node["progressAt"] = progress_at
        eta = _eta(reading)
        if eta is not None:
            node["etaSeconds"] = eta
        nodes.append(node)
    nodes.sort(key=lambda n: n["pod"])
    summary = _summary([r for _, r in readings]) if readings else (
        f"no answer from {len(kept)} running loaders")
    return {"summary": summary, "nodes": nodes}


def _eta(reading: LoaderReading) -> int | None:
    if reading.stalled or reading.bytes_per_second <= 0:
        return None
    return round(max(reading.bytes_total - reading.bytes_done, 0) / reading.bytes_per_second)


def _summary(readings: Sequence[LoaderReading]) -> str:
    done = sum(r.bytes_done for r in readings)
    total = sum(r.bytes_total for r in readings)
    rate = sum(r.bytes_per_second for r in readings)
    share = f"{100 * done / total:.0f}% " if total else ""
    line = f"{share}{human_bytes(done)}/{human_bytes(total)}, {human_bytes(rate)}/s"
    stalled = sum(r.stalled for r in readings)
    if stalled:
        return f"{line}, stalled ({stalled} of {len(readings)} loaders)"
    etas = [_eta(r) for r in readings]
    if all(e is not None for e in etas):
        return f"{line}, ETA {human_eta(max(e for e in etas if e is not None))}"
    return line

