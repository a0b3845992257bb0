"""Streamed generations against the demo model served on loopback: the Hugging Face routes'
server-sent events (place in the queue, steps, previews, then the image, bitwise the plain
answer's), OpenAI's `stream=True` read by the real openai client (partial images, then
completed, bitwise the non-streamed `b64_json`; edits in their own shapes), refusals before the
stream with their status, an error in the stream, a client that leaves, and the progress board."""

import base64
import io
import json
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from support.fakes import serve_on_loopback

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.previews import Preview
from loraswap.errors import Overloaded
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

PROMPT = "a red circle at the left on white"
STREAM = {"accept": "text/event-stream, image/png"}


@pytest.fixture(scope="module")
def served():
    """(url, app): the demo model on loopback."""
    app = create_app(ServerConfig(engines=[EngineConfig(model="demo", compile=False, warmup=False)]))
    with serve_on_loopback(app) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            while client.get("/ready").status_code != 200:
                time.sleep(0.05)
        yield url, app


@pytest.fixture
def openai_client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=60, max_retries=0)


def each_event(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent event stream as they come; comment lines skipped
    (the first line is the `: started` comment, sent at once)."""
    name = None
    lines = response.iter_lines()
    assert next(lines) == ": started"
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, json.loads(line.removeprefix("data: "))


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    return list(each_event(response))


def streamed(url: str, body: dict, headers=STREAM) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    with httpx.stream("POST", url + "/", json=body, headers=headers, timeout=60) as response:
        return response, events(response) if response.status_code == 200 else response.read()


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_hf_stream_is_steps_previews_then_the_image_of_the_plain_answer(served):
    url, _ = served
    body = {"inputs": PROMPT, "parameters": {"seed": 5, "preview_every": 5}}
    response, got = streamed(url, body)
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [name for name, _ in got]
    assert names[-1] == "image" and set(names) <= {"queued", "progress", "preview", "image"}
    steps = [data["step"] for name, data in got if name == "progress"]
    assert steps == sorted(steps) and steps[-1] == 20 and {data["total"] for n, data in got if n == "progress"} == {20}
    elapsed = [data["elapsed"] for name, data in got if name in ("progress", "preview")]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    previews = [data for name, data in got if name == "preview"]
    assert previews and {p["step"] for p in previews} <= {5, 10, 15}, "every 5 steps, none after the last"
    for preview in previews:
        assert preview["content_type"] == "image/png"
        assert pixels(base64.b64decode(preview["image"])).shape == (32, 32, 3), "at the image's size"
    final = got[-1][1]
    plain = httpx.post(url + "/", json={"inputs": PROMPT, "parameters": {"seed": 5}}, headers={"accept": "image/png"},
                       timeout=60)
    assert base64.b64decode(final["image"]) == plain.content, "bitwise the plain answer's file"
    assert final["content_type"] == "image/png" and final["seed"] == int(plain.headers["x-seed"]) == 5
    assert final["compute_time"] > 0 and "generate;dur=" in final["server_timing"]


def test_parameters_stream_true_streams_without_accept_and_false_answers_the_plain_image(served):
    url, _ = served
    response, got = streamed(url, {"inputs": PROMPT, "parameters": {"seed": 1, "stream": True,
                                                                    "num_inference_steps": 4}}, {})
    assert [name for name, _ in got][-1] == "image" and got[-1][1]["content_type"] == "image/jpeg", "JPEG by default"
    plain = httpx.post(url + "/", json={"inputs": PROMPT, "parameters": {"seed": 1, "stream": False,
                                                                         "num_inference_steps": 4}},
                       headers=STREAM, timeout=60)
    assert plain.headers["content-type"] == "image/png" and plain.content[:4] == b"\x89PNG"


@pytest.mark.parametrize(("parameters", "headers", "status", "named"), [
    ({"preview_every": 0}, {}, 400, "preview_every"),
    ({"preview_every": 101}, {}, 400, "preview_every"),
    ({"preview_every": 2, "preview_full": True, "num_inference_steps": 20}, {}, 400, "preview_every"),
    ({"preview_every": 4, "preview_full": True}, {}, 400, "preview_every"),  # up to 100 steps: 24
    ({"preview_full": True}, {}, 400, "preview_full"),
    ({"preview_every": 5}, {"accept": "image/png"}, 400, "text/event-stream"),
    ({"num_inference_steps": 4}, {"lora": "no-such-adapter"}, 404, "no-such-adapter")])
def test_a_refusal_before_the_queue_is_answered_with_its_status(served, parameters, headers, status, named):
    response, body = streamed(served[0], {"inputs": PROMPT, "parameters": parameters}, {**STREAM, **headers})
    assert response.status_code == status and response.headers["content-type"] == "application/json"
    assert named in json.loads(body)["error"]


def test_openai_client_streams_partial_images_then_the_completed_image(openai_client):
    stream = openai_client.images.generate(model="demo", prompt=PROMPT, stream=True, partial_images=2,
                                           extra_body={"seed": 9})
    got = list(stream)
    assert [e.type for e in got] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in got[:2]] == [0, 1]
    assert {(e.size, e.output_format) for e in got} == {("32x32", "png")}
    assert got[-1].usage.total_tokens == 0 and all(e.created_at > 1.7e9 for e in got)
    plain = openai_client.images.generate(model="demo", prompt=PROMPT, extra_body={"seed": 9})
    assert got[-1].b64_json == plain.data[0].b64_json, "bitwise the non-streamed image"
    assert pixels(base64.b64decode(got[0].b64_json)).shape == (32, 32, 3)


def _source_png() -> bytes:
    source = io.BytesIO()
    Image.new("RGB", (32, 32), (240, 240, 240)).save(source, "PNG")
    return source.getvalue()


def test_openai_edits_stream_in_their_own_shapes_and_complete_with_the_plain_edit(openai_client):
    edit = {"image": ("in.png", _source_png(), "image/png"), "prompt": PROMPT, "model": "demo",
            "extra_body": {"seed": 2, "strength": 0.9}}
    got = list(openai_client.images.edit(**edit, stream=True, partial_images=1))
    assert [e.type for e in got] == ["image_edit.partial_image", "image_edit.completed"]
    assert got[0].size == got[1].size == "32x32"
    assert pixels(base64.b64decode(got[0].b64_json)).shape == (32, 32, 3)
    plain = openai_client.images.edit(**edit)
    assert got[1].b64_json == plain.data[0].b64_json, "bitwise the non-streamed edit"


def test_a_stream_cannot_answer_by_url(openai_client):
    with pytest.raises(openai.BadRequestError, match="response_format") as caught:
        openai_client.images.generate(model="demo", prompt=PROMPT, stream=True, response_format="url")
    assert "stream" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="preview_full"):
        openai_client.images.generate(model="demo", prompt=PROMPT, extra_body={"preview_full": True})


def test_a_streamed_edit_gives_its_decoded_input_back_once_its_image_is_made(served):
    """The decode budget holds the edit's input while it generates, and nothing once its image
    is made (before the stream ends), or once its client has left."""
    url, app = served
    budget = app.state.decode_budget
    body = {"inputs": base64.b64encode(_source_png()).decode(),
            "parameters": {"prompt": PROMPT, "num_inference_steps": 30, "strength": 0.9}}
    for leaves in (False, True):
        with httpx.stream("POST", url + "/", json=body, headers=STREAM, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("event: progress")) and budget.held > 0
            if not leaves:
                assert next(line for line in lines if line.startswith("event: image")) and budget.held == 0
        _until(lambda: budget.held == 0)


def test_no_partial_images_is_one_completed_event_and_more_than_three_are_refused(openai_client):
    got = list(openai_client.images.generate(model="demo", prompt=PROMPT, stream=True, partial_images=0,
                                             extra_body={"seed": 1, "num_inference_steps": 4}))
    assert [e.type for e in got] == ["image_generation.completed"]
    with pytest.raises(openai.BadRequestError, match="partial_images"):
        list(openai_client.images.generate(model="demo", prompt=PROMPT, stream=True, partial_images=4))


class OnePicture:
    """Stands in for a step's latents: a grey picture of each image asked for."""

    def pictures(self, indices, full):
        return [Preview(torch.full((3, 32, 32), 128, dtype=torch.uint8)) for _ in indices]


def test_an_error_after_the_stream_began_is_an_error_event(served, openai_client, monkeypatch):
    """The job fails only once the client has read its first event: the answer was 200 and
    under way, so the error can only be an event in it."""
    url, app = served
    first_read = threading.Event()

    def fails_after_the_first_event(requests, lease, on_step=None, on_latents=None):
        on_step(10, 20)
        if on_latents is not None:
            on_latents(10, 20, OnePicture())
        assert first_read.wait(30), "the client never read its first event"
        raise Overloaded("the GPU is busy elsewhere; retry")

    monkeypatch.setattr(app.state.deployment.hosted[0].engine, "generate_batch", fails_after_the_first_event)
    got = []
    with httpx.stream("POST", url + "/", json={"inputs": PROMPT}, headers=STREAM, timeout=60) as response:
        for name, data in each_event(response):
            got.append((name, data))
            first_read.set()
    assert response.status_code == 200 and "progress" in [name for name, _ in got]
    assert got[-1] == ("error", {"error": "the GPU is busy elsewhere; retry"})
    first_read.clear()
    stream = iter(openai_client.images.generate(model="demo", prompt=PROMPT, stream=True, partial_images=1))
    assert next(stream).type == "image_generation.partial_image"
    first_read.set()
    with pytest.raises(openai.APIError, match="the GPU is busy elsewhere") as caught:
        list(stream)
    assert not isinstance(caught.value, openai.APIStatusError), "an event in the stream, not an error status"
    monkeypatch.undo()
    assert streamed(url, {"inputs": PROMPT, "parameters": {"num_inference_steps": 2}})[1][-1][0] == "image"


def test_a_failure_encoding_the_image_is_an_error_event_and_a_failed_preview_is_skipped(served, monkeypatch, caplog):
    import loraswap.server.streaming.events as streaming

    url, _ = served
    monkeypatch.setattr(streaming, "INLINE_PIXELS", 0)  # every preview encoded on a thread, through `encoded`
    monkeypatch.setattr(streaming, "encode_image", lambda *a, **k: 1 / 0)  # the previews' encoder
    monkeypatch.setattr(streaming, "encode", lambda *a, **k: 1 / 0)  # the image's
    with caplog.at_level(logging.WARNING, logger="loraswap.server"):
        response, got = streamed(url, {"inputs": PROMPT, "parameters": {"num_inference_steps": 4, "preview_every": 1}})
    assert response.status_code == 200 and "preview" not in [name for name, _ in got]
    assert got[-1] == ("error", {"error": "internal server error"}) and "could not be encoded" in caplog.text


def _running_in_thread(url: str, body: dict) -> threading.Thread:
    thread = threading.Thread(target=httpx.post, args=(url + "/",), kwargs={"json": body, "timeout": 60})
    thread.start()
    return thread


def _until(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return value


def test_a_waiting_request_hears_its_place_and_the_board_shows_a_plain_one(served):
    url, app = served
    board = app.state.progress
    first = _running_in_thread(url, {"inputs": PROMPT, "parameters": {"num_inference_steps": 100}})
    now = _until(lambda: (p := board.current()) and p.step > 0 and p)
    assert (now.route, now.total, now.queued, now.preview) == ("/", 100, None, None) and now.elapsed > 0
    _, got = streamed(url, {"inputs": PROMPT, "parameters": {"num_inference_steps": 2}})
    assert got[0] == ("queued", {"position": 0}), "behind the running request, first in the queue"
    first.join(60)
    assert board.in_flight() == []


def test_a_client_that_leaves_stops_its_image_and_no_error_is_logged(served, caplog):
    caplog.set_level(logging.INFO)
    url, app = served
    worker, board = app.state.deployment.hosted[0].worker, app.state.progress
    stopped = worker.stopped
    with httpx.stream("POST", url + "/", json={"inputs": PROMPT, "parameters": {"num_inference_steps": 100}},
                      headers=STREAM, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("event: progress"):
                break
    _until(lambda: worker.stopped == stopped + 1)
    _until(lambda: board.in_flight() == [])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a1111_clients_read_the_progress_of_a_running_image_and_its_latest_preview(served):
    """webuiapi's `get_progress` (A1111's `/sdapi/v1/progress`): nothing in flight, then a plain
    request at its steps (no picture: it asked for none), then a streamed one with previews."""
    import webuiapi

    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    a1111 = webuiapi.WebUIApi(host=host, port=int(port))
    idle = a1111.get_progress()
    assert (idle["progress"], idle["state"]["job_count"], idle["current_image"]) == (0.0, 0, None)
    first = _running_in_thread(url, {"inputs": PROMPT, "parameters": {"num_inference_steps": 100}})
    now = _until(lambda: (p := a1111.get_progress())["state"]["sampling_step"] > 0 and p)
    assert now["state"]["sampling_steps"] == 100 and now["progress"] == now["state"]["sampling_step"] / 100
    assert now["eta_relative"] > 0 and now["current_image"] is None and now["state"]["job_count"] == 1
    first.join(60)
    body = {"inputs": PROMPT, "parameters": {"num_inference_steps": 40, "stream": True, "preview_every": 1}}
    streaming = threading.Thread(target=streamed, args=(url, body))
    streaming.start()
    now = _until(lambda: (p := a1111.get_progress())["current_image"] and p)
    picture = Image.open(io.BytesIO(base64.b64decode(now["current_image"])))
    assert picture.format == "PNG" and picture.size == (32, 32)
    streaming.join(60)
