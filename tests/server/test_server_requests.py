"""The request body checks and the wave rule, without a server."""

from __future__ import annotations

import pytest

from dlo_server.requests import Job, Limits, RequestError, parse_request
from dlo_server.waves import QueueClosed, QueueFull, WaveQueue

LIMITS = Limits(size_multiple=4, max_side=64, max_steps=8, max_n=3)


def test_a_full_request_becomes_one_job_of_n_images() -> None:
    parsed = parse_request({"prompt": "a cat", "n": 2, "size": "32x16", "seed": 7,
                            "num_inference_steps": 3, "guidance_scale": 2,
                            "response_format": "b64_json", "model": "dlo"}, LIMITS,
                           default_seed=0)
    assert parsed.jobs() == [Job("a cat", 32, 16, 3, 2.0, 7, n=2)]


def test_defaults_fill_what_the_body_leaves_out() -> None:
    parsed = parse_request({"prompt": "a cat"}, LIMITS, default_seed=11)
    assert (parsed.n, parsed.width, parsed.height, parsed.steps, parsed.seed) == (
        1, 64, 64, LIMITS.default_steps, 11)


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"prompt": "x", "size": "30x32"}, "size", "30 is not a multiple of 4"),
    ({"prompt": "x", "size": "128x32"}, "size", "from 4 to 64"),
    ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "1 to 8"),
    ({"prompt": "x", "num_inference_steps": 9}, "num_inference_steps", "1 to 8"),
    ({"prompt": "x", "num_inference_steps": 2.5}, "num_inference_steps", "not an integer"),
    ({"prompt": "x", "n": 4}, "n", "1 to 3"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale", "not a number"),
    ({"prompt": "x", "response_format": "url"}, "response_format", "'url' is not served"),
    ({"prompt": "x", "quality": "hd"}, "quality", "unknown field"),
    ({"prompt": "x", "model": "sdxl"}, "model", "'sdxl' is not served here"),
    ({"size": "32x32"}, "prompt", "is required"),
    (["x"], "body", "JSON object"),
])
def test_a_bad_request_names_its_field(body: object, field: str, words: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(body, LIMITS, default_seed=0)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ") and words in str(caught.value)


TEXT = ("accepted: Unicode text, with tab, newline and carriage return as its only control "
        "characters")


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "\ud800"}, f"prompt: character 0 ('\\ud800') is a lone surrogate; {TEXT}"),
    ({"prompt": "a\x00b"}, f"prompt: character 1 ('\\x00') is a control character; {TEXT}"),
    ({"prompt": "x\x1b[2J"}, f"prompt: character 1 ('\\x1b') is a control character; {TEXT}"),
    ({"prompt": "x" * 4001}, "prompt: has 4001 characters; accepted: at most 4000"),
    ({"prompt": "x", "size": "\u00b2x\u00b2"},
     "size: '\\xb2x\\xb2' is not WIDTHxHEIGHT, each a multiple of 4 from 4 to 64"),
    ({"prompt": "x", "size": "\u0663\u0662x\u0663\u0662"},
     "size: '\\u0663\\u0662x\\u0663\\u0662' is not WIDTHxHEIGHT, each a multiple of 4 "
     "from 4 to 64"),
    ({"prompt": "x", "size": "9" * 5000 + "x8"},
     f"size: '{'9' * 40}' is not WIDTHxHEIGHT, each a multiple of 4 from 4 to 64"),
    ({"prompt": "x", "guidance_scale": float("nan")},
     "guidance_scale: nan is out of bounds; accepted: a number from 0 to 100"),
    ({"prompt": "x", "guidance_scale": float("inf")},
     "guidance_scale: inf is out of bounds; accepted: a number from 0 to 100"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale: -1 is out of bounds; accepted: "
                                            "a number from 0 to 100"),
    ({"prompt": "x", "guidance_scale": 10**400}, f"guidance_scale: {10**400} is out of bounds; "
                                                 "accepted: a number from 0 to 100"),
])
def test_what_no_pipeline_can_take_is_refused_with_its_field(body: dict, message: str) -> None:
    """Each of these once reached the ranks (a 500, a hung AllGather wave) or was served as
    something else ("\u0663\u0662" is 32 to `int`)."""
    with pytest.raises(RequestError) as caught:
        parse_request(body, LIMITS, default_seed=0)
    assert str(caught.value) == message


def test_a_prompt_is_text_up_to_the_bound_with_whitespace_and_format_characters() -> None:
    prompt = "a cat\tin a hat,\r\nsmiling \U0001F469\u200d\U0001F52C"
    prompt += "x" * (LIMITS.max_prompt_chars - len(prompt))
    assert len(prompt) == LIMITS.max_prompt_chars
    assert parse_request({"prompt": prompt}, LIMITS, default_seed=0).prompt == prompt


def job(steps: int, seed: int = 0) -> Job:
    return Job("x", 8, 8, steps, 0.0, seed)


def test_waves_hold_one_step_count_led_by_the_oldest_job() -> None:
    queue = WaveQueue(capacity=10, ranks=2)
    queue.submit([job(2, 0), job(3, 1), job(2, 2), job(2, 3), job(3, 4)])
    waves = [[(p.job.steps, p.job.seed) for p in queue.take_wave(0)] for _ in range(3)]
    assert waves == [[(2, 0), (2, 2)], [(3, 1), (3, 4)], [(2, 3)]]
    assert queue.take_wave(0) is None


def test_rank_local_ranks_take_the_oldest_job_alone() -> None:
    queue = WaveQueue(capacity=10, ranks=2)
    queue.submit([job(2, 0), job(3, 1), job(2, 2)])
    assert [[p.job.seed for p in queue.take_wave(0, size=1)] for _ in range(3)] == [[0], [1], [2]]


def test_a_request_that_does_not_fit_is_refused_whole() -> None:
    queue = WaveQueue(capacity=3, ranks=2)
    queue.submit([job(2), job(2)])
    with pytest.raises(QueueFull) as caught:
        queue.submit([job(2), job(2)])
    assert caught.value.retry_after_s >= 1
    assert queue.depth == 2


def test_a_closed_queue_drains_then_ends_and_fail_all_fails_the_rest() -> None:
    queue = WaveQueue(capacity=4, ranks=1)
    first, second = queue.submit([job(2), job(2)])
    queue.close()
    with pytest.raises(QueueClosed):
        queue.submit([job(2)])
    assert len(queue.take_wave(0)) == 1
    queue.fail_all(RuntimeError("rank 1 exited"))
    assert queue.take_wave(0) == []
    assert not first.done() and isinstance(second.exception(), RuntimeError)


def test_jobs_of_a_request_whose_client_went_away_are_dropped() -> None:
    queue = WaveQueue(capacity=4, ranks=2)
    gone, kept = queue.submit([job(2, 0), job(2, 1)])
    assert gone.cancel()
    [taken] = queue.take_wave(0)
    assert taken.job.seed == 1 and taken.future is kept
    assert not kept.cancel()  # taken into a wave: running, the engine will resolve it
    queue.submit([job(3, 2)])[0].cancel()
    assert queue.take_wave(0) is None


def test_an_abandoned_requests_jobs_hold_no_slot() -> None:
    queue = WaveQueue(capacity=2, ranks=2)
    for future in queue.submit([job(2, 0), job(2, 1)]):
        assert future.cancel()  # its client went away
    assert queue.depth == 0
    kept = queue.submit([job(2, 2), job(2, 3)])
    assert [p.future for p in queue.take_wave(0)] == kept
