"""The HTTP API of a real `dlo serve` process (one rank, offloaded from a published entry):
images for good requests, a 400 naming the field for bad ones, 503 with Retry-After when the
queue cannot take a request, the probes and /metrics."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import requests
from PIL import Image
from support.scrape import scrape, value
from support.server_helpers import PodFiles, RunningServer, png_of, references

pytestmark = pytest.mark.slow


def test_a_request_gets_the_resident_pipelines_png(one_rank_server: RunningServer,
                                                   one_rank_files: PodFiles,
                                                   tmp_path: Path) -> None:
    response = one_rank_server.generate({"prompt": "a red fox", "size": "32x16", "seed": 5,
                                         "num_inference_steps": 3, "n": 1,
                                         "response_format": "b64_json"})
    body = response.json()
    assert isinstance(body["created"], int)
    [png] = png_of(response)
    image = Image.open(io.BytesIO(png))
    assert (image.format, image.size, image.mode) == ("PNG", (32, 16), "RGB")
    job = {"prompt": "a red fox", "width": 32, "height": 16, "steps": 3, "guidance_scale": 3.5,
           "seed": 5}
    other = {**job, "seed": 6}
    [expected], [different] = references(one_rank_files, [job, other], tmp_path / "jobs.json")
    assert png == expected
    assert png != different  # the seed matters: equality above is not a constant image


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "size": "30x32"}, "size"),
    ({"prompt": "x", "num_inference_steps": 51}, "num_inference_steps"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "style": "vivid"}, "style"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"n": 1}, "prompt"),
])
def test_a_bad_request_gets_400_naming_the_field(one_rank_server: RunningServer, body: dict,
                                                 field: str) -> None:
    response = one_rank_server.generate(body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert error["message"].startswith(f"{field}: ")


def test_a_body_that_is_not_json_gets_400(one_rank_server: RunningServer) -> None:
    response = requests.post(one_rank_server.url + "/v1/images/generations", data=b"{",
                             timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


def test_a_request_the_queue_cannot_take_gets_503_with_retry_after(
        one_rank_server: RunningServer) -> None:
    response = one_rank_server.generate({"prompt": "x", "n": 2, "size": "8x8"})
    assert response.status_code == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["type"] == "server_busy"


def test_probes_pass_and_metrics_count_requests_waves_and_offload(
        one_rank_server: RunningServer) -> None:
    for probe in ("startup", "ready", "live"):
        answer = one_rank_server.get(f"/health/{probe}")
        assert (answer.status_code, answer.json()["state"]) == (200, "ready")
    png_of(one_rank_server.generate({"prompt": "x", "size": "8x8", "num_inference_steps": 2}))
    one_rank_server.generate({"prompt": "x", "size": "7x8"})
    samples = scrape(one_rank_server.port)
    assert value(samples, "dlo_server_request_seconds_count", outcome="ok") >= 1
    assert value(samples, "dlo_server_request_seconds_count", outcome="invalid") >= 1
    assert value(samples, "dlo_server_images_total") >= 1  # one rank: rank-local, no waves
    assert value(samples, "dlo_server_queue_depth") == 0
    assert value(samples, "dlo_runtime_forwards_total", component="transformer") >= 2
