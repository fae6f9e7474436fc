"""The videos API of `dlo serve` (OpenAI's videos API shape): a video is an async job.

Owns the routes `POST /v1/videos` (queue a job: `{"id", "object": "video", "status": "queued",
"progress", ...}`), `GET /v1/videos/{id}` (its status: queued, in_progress, completed or failed,
and progress, 0 until completed, then 100) and `GET /v1/videos/{id}/content` (the MP4, H.264 at
`FPS`; `?variant=frames`: the frames themselves, uint8 (frames, height, width, 3) as a `.npy`
file). Jobs live in this process only: a restart loses them, and the `KEPT` newest finished ones
are kept. Called by `dlo_server.app`, which registers the routes; the engine makes the frames.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from aiohttp import web

from dlo_server.requests import Job, RequestError, parse_video_request
from dlo_server.status import Probe
from dlo_server.waves import QueueClosed, QueueFull

VIDEOS = "/v1/videos"
FPS = 16
"""Frames per second of the MP4 (Wan's rate)."""
KEPT = 64
"""Finished jobs kept (the oldest go first); their MP4s stay in memory until then."""


class JobStatus(str, Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass
class VideoJob:
    """One video: its job, its frames and MP4 once made, or its error."""

    id: str
    job: Job
    created_at: int
    future: Any
    frames: np.ndarray | None = None
    mp4: bytes | None = None
    error: str | None = None
    finished_at: float = field(default=0.0)

    @property
    def status(self) -> JobStatus:
        if self.mp4 is not None:
            return JobStatus.COMPLETED
        if self.error is not None:
            return JobStatus.FAILED
        return JobStatus.IN_PROGRESS if self.future.running() else JobStatus.QUEUED

    def answer(self, model: str) -> dict[str, Any]:
        status = self.status
        body = {"id": self.id, "object": "video", "model": model, "status": status.value,
                "progress": 100 if status is JobStatus.COMPLETED else 0,
                "created_at": self.created_at, "size": f"{self.job.width}x{self.job.height}",
                "num_frames": self.job.frames, "seconds": f"{self.job.frames / FPS:g}"}
        if self.error is not None:
            body["error"] = {"code": "generation_failed", "message": self.error}
        return body


class Videos:
    """The jobs of one server; `server` is the `app.Server` (its status, queue and limits)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._jobs: dict[str, VideoJob] = {}
        self._tasks: set[asyncio.Task] = set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(VIDEOS, self.create)
        app.router.add_get(VIDEOS + "/{id}", self.retrieve)
        app.router.add_get(VIDEOS + "/{id}/content", self.content)

    async def create(self, request: web.Request) -> web.Response:
        server = self.server
        answer = server.status.probe(Probe.READINESS)
        if answer.code != 200 or server.limits is None:
            return _error(503, f"the server is {answer.state.value}: {answer.detail}",
                          "server_unavailable")
        try:
            job = parse_video_request(await _body(request), server.limits,
                                      default_seed=random.randrange(2**31))
            [future] = server.queue.submit([job])
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.field)
        except (QueueFull, QueueClosed) as exc:
            return _error(503, str(exc), "server_busy")
        video = VideoJob(f"video_{uuid.uuid4().hex}", job, int(time.time()), future)
        self._jobs[video.id] = video
        task = asyncio.create_task(self._finish(video))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.json_response(video.answer(server.limits.model))

    async def retrieve(self, request: web.Request) -> web.Response:
        video = self._jobs.get(request.match_info["id"])
        if video is None:
            return _not_found(request.match_info["id"])
        return web.json_response(video.answer(self.server.limits.model))

    async def content(self, request: web.Request) -> web.Response:
        video = self._jobs.get(request.match_info["id"])
        if video is None:
            return _not_found(request.match_info["id"])
        if video.status is not JobStatus.COMPLETED:
            return _error(409, f"video {video.id} is {video.status.value}, not completed",
                          "invalid_request_error", "id")
        if request.query.get("variant", "video") == "frames":
            buffer = io.BytesIO()
            np.save(buffer, video.frames)
            return web.Response(body=buffer.getvalue(), content_type="application/octet-stream")
        return web.Response(body=video.mp4, content_type="video/mp4")

    async def _finish(self, video: VideoJob) -> None:
        try:
            [frames] = await asyncio.wrap_future(video.future)
            video.frames = frames
            video.mp4 = await asyncio.to_thread(encode_mp4, frames, FPS)
        except Exception as exc:  # noqa: BLE001 (the job's failure is its status)
            video.error = f"the video could not be made: {exc}"
        video.finished_at = time.monotonic()
        finished = sorted((item for item in self._jobs.values() if item.finished_at),
                          key=lambda item: item.finished_at)
        for old in finished[:-KEPT]:
            del self._jobs[old.id]


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """`frames` (uint8, (frames, height, width, 3)) as an H.264 MP4."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise RequestError("body", "not JSON") from exc


def _not_found(video_id: str) -> web.Response:
    return _error(404, f"no video {video_id!r} (jobs live in the server process: a restart "
                       "loses them)", "invalid_request_error", "id")


def _error(code: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": None}}, status=code)
