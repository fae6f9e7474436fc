"""The HTTP side of `dlo serve` (aiohttp): the images API, the probes and `/metrics`.

Owns the routes and their answers. `POST /v1/images/generations` takes the OpenAI images API's
body (`dlo_server.requests`) and answers `{"created", "data": [{"b64_json"}]}` with PNGs, or an
OpenAI-shaped error: 400 naming the field (`param`), 503 with Retry-After when the queue is full
or the server is not ready, 500 when the wave failed. `/health/startup`, `/health/ready` and
`/health/live` (and `/health`, the readiness answer) report `status.Status`. The handlers only
queue jobs and await their futures; the engine thread makes the images.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dlo_server.metrics import ServerMetrics
from dlo_server.requests import Limits, RequestError, parse_request
from dlo_server.status import Probe, Status
from dlo_server.waves import QueueClosed, QueueFull, WaveQueue

GENERATIONS = "/v1/images/generations"
PROBES = {"/health/startup": Probe.STARTUP, "/health/ready": Probe.READINESS,
          "/health/live": Probe.LIVENESS, "/health": Probe.READINESS}
NOT_READY_RETRY_S = 5


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
        return app

    async def generations(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        outcome, response = await self._generate(request)
        self.metrics.request_seconds.labels(outcome).observe(time.monotonic() - started)
        return response

    async def _generate(self, request: web.Request) -> tuple[str, web.Response]:
        answer = self.status.probe(Probe.READINESS)
        if answer.code != 200 or self.limits is None:
            return "unavailable", _error(503, f"the server is {answer.state.value}: "
                                              f"{answer.detail}", "server_unavailable",
                                         retry_after=NOT_READY_RETRY_S)
        try:
            body = await request.json()
        except ValueError:
            return "invalid", _error(400, "body: not JSON", "invalid_request_error", "body")
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
            images = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except Exception as exc:  # noqa: BLE001 (the wave's failure is this request's 500)
            return "failed", _error(500, f"the image could not be made: {exc}", "server_error")
        data = [{"b64_json": _b64(image)} for image in images]
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


def _error(code: int, message: str, kind: str, param: str | None = None, *,
           retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": None}}, status=code, headers=headers)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")

