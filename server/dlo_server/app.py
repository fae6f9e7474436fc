"""The HTTP side of `dlo serve` (aiohttp): the images API, the probes and `/metrics`.

Owns the routes and their answers. `POST /v1/images/generations` takes the OpenAI images API's
body (`dlo_server.requests`) and answers `{"created", "data": [{"b64_json"}]}` with PNGs, or an
OpenAI-shaped error: 400 naming the field (`param`; `body` for a body that is not a JSON object),
413 for a body over `Limits.max_body_bytes`, 503 with Retry-After when the queue is full or the
server is not ready, 500 when the request's job failed. Every answer, and every request whose
client went away first (`abandoned`), is counted in `dlo_server_request_seconds`.
`/health/startup`, `/health/ready` and `/health/live` (and `/health`, the readiness answer)
report `status.Status`. The handlers only queue jobs and await their futures; the engine thread
makes the images. A client that goes away cancels its handler (the runner is started with
`handler_cancellation=True`), which cancels the futures of its jobs still queued, so the queue
drops them (`waves.WaveQueue`): an abandoned request takes no queue slot and no compute beyond
the jobs already running.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dlo_server.metrics import ServerMetrics
from dlo_server.requests import Limits, RequestError, parse_request
from dlo_server.status import Probe, Status
from dlo_server.videos import Videos
from dlo_server.waves import QueueClosed, QueueFull, WaveQueue

log = logging.getLogger(__name__)

GENERATIONS = "/v1/images/generations"
PROBES = {"/health/startup": Probe.STARTUP, "/health/ready": Probe.READINESS,
          "/health/live": Probe.LIVENESS, "/health": Probe.READINESS}
NOT_READY_RETRY_S = 5
_READ_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    """The request's body is over the bound; `limit` is the bound in bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body: over {limit} bytes; a request (its prompt included) must fit "
                         f"in {limit} bytes")
        self.limit = limit


class Server:
    """What the handlers share: the state, the queue, the metrics and (once ready) the limits."""

    def __init__(self, status: Status, queue: WaveQueue, metrics: ServerMetrics) -> None:
        self.status = status
        self.queue = queue
        self.metrics = metrics
        self.limits: Limits | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(GENERATIONS, self.generations)
        for path, probe in PROBES.items():
            app.router.add_get(path, self._probe_handler(probe))
        app.router.add_get("/metrics", self.metrics_page)
        Videos(self).add_routes(app)
        return app

    async def generations(self, request: web.Request) -> web.Response:
        """Every request is counted once, by its outcome: its answer's, or `abandoned` when the
        client went away first (the handler is cancelled)."""
        started, outcome = time.monotonic(), "abandoned"
        try:
            outcome, response = await self._generate(request)
        except Exception:  # noqa: BLE001 (a fault of the server: logged, the client gets 500)
            log.exception("dlo serve: a generation request failed")
            outcome, response = "failed", _error(500, "the server failed to answer; its log "
                                                      "says why", "server_error")
        finally:
            self.metrics.request_seconds.labels(outcome).observe(time.monotonic() - started)
        return response

    async def _generate(self, request: web.Request) -> tuple[str, web.Response]:
        answer = self.status.probe(Probe.READINESS)
        if answer.code != 200 or self.limits is None:
            return "unavailable", _error(503, f"the server is {answer.state.value}: "
                                              f"{answer.detail}", "server_unavailable",
                                         retry_after=NOT_READY_RETRY_S)
        try:
            body = _decode(await _read_body(request, self.limits.max_body_bytes))
        except BodyTooLarge as exc:
            return "invalid", _error(413, str(exc), "invalid_request_error", "body")
        except RequestError as exc:
            return "invalid", _error(400, str(exc), "invalid_request_error", exc.field)
        try:
            parsed = parse_request(body, self.limits, default_seed=random.randrange(2**31))
        except RequestError as exc:
            return "invalid", _error(400, str(exc), "invalid_request_error", exc.field)
        try:
            futures = self.queue.submit(parsed.jobs())
        except QueueFull as exc:
            return "busy", _error(503, str(exc), "server_busy", retry_after=exc.retry_after_s)
        except QueueClosed as exc:
            return "unavailable", _error(503, str(exc), "server_unavailable",
                                         retry_after=NOT_READY_RETRY_S)
        self.metrics.queue_depth.set(self.queue.depth)
        try:
            with self.metrics.in_flight.track_inprogress():
                images = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except QueueClosed as exc:  # stopped before its images were made (cli's --stop-timeout)
            return "unavailable", _error(503, str(exc), "server_unavailable",
                                         retry_after=NOT_READY_RETRY_S)
        except Exception as exc:  # noqa: BLE001 (the wave's failure is this request's 500)
            return "failed", _error(500, f"the image could not be made: {exc}", "server_error")
        data = [{"b64_json": _b64(png)} for pngs in images for png in pngs]
        return "ok", web.json_response({"created": int(time.time()), "data": data})

    def _probe_handler(self, probe: Probe) -> Any:
        async def handler(_request: web.Request) -> web.Response:
            answer = self.status.probe(probe)
            return web.json_response({"state": answer.state.value, "detail": answer.detail},
                                     status=answer.code)
        return handler

    async def metrics_page(self, _request: web.Request) -> web.Response:
        self.metrics.queue_depth.set(self.queue.depth)
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes: `BodyTooLarge` as soon as it is over, whatever its
    Content-Length says (a chunked body has none)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for chunk in request.content.iter_chunked(_READ_CHUNK):
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)


def _decode(raw: bytes) -> Any:
    """The JSON value of `raw`; `RequestError` on the field `body` when it is not JSON, or is
    nested deeper than the parser's recursion bound (a request is two levels deep)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("body", "JSON nested too deep; a request is a flat JSON "
                                   "object") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError("body", f"not JSON: {exc}") from None


def _error(code: int, message: str, kind: str, param: str | None = None, *,
           retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": None}}, status=code, headers=headers)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")

