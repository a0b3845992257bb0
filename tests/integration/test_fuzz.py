"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis), against a real server.

Every operation gets schema-conforming and schema-violating requests (bodies, the `lora`
header, path ids). Each answer must be a documented status with a documented body, never
a 5xx and never a traceback; schema-violating requests must be refused with a 4xx; and
the server process must outlive the run and still generate.
"""

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from support.servers import ServerProcess

from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

pytestmark = pytest.mark.slow  # schemathesis over the whole API

EXAMPLES_PER_OPERATION = 40  # 14 operations x 2 modes: ~1100 requests, 60-90 s on 2 busy cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
SEEN = {"requests": 0, "statuses": {}, "started": None}
# valid generations stay cheap; the fuzzer's video jobs never meet the cap on those unfinished (503)
LIMITS = {"max_width": 64, "max_height": 64, "max_steps": 2, "max_video_jobs_pending": 64}


@pytest.fixture(scope="module")
def fuzz_server(served_adapters, tmp_path_factory):
    limits = [arg for name, value in LIMITS.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    process = ServerProcess(["--model", "tiny-sd", "--adapters", str(served_adapters), "--max-queue", "64", *limits],
                            tmp_path_factory.mktemp("logs") / "fuzz.log")
    process.wait_ready()
    yield process
    process.stop()


def _schema():
    """The schema the server publishes at /openapi.json (built from the app, not its engines)."""
    openapi = create_app(ServerConfig(**LIMITS)).openapi()
    schema = schemathesis.openapi.from_dict(openapi)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES_PER_OPERATION, deterministic=True)
    return schema


schema = _schema()


def test_the_published_schema_is_the_one_fuzzed(fuzz_server):
    assert httpx.get(fuzz_server.url + "/openapi.json").json() == create_app(ServerConfig(**LIMITS)).openapi()


def no_traceback(ctx, response, case):
    body = response.content  # images are bytes; any text in them is checked too
    if b"Traceback" in body or b'File "' in body:
        raise AssertionError(f"a traceback reached the client: {body[:300]!r}")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_answers_every_generated_request_with_a_documented_4xx_or_2xx(case, fuzz_server):
    SEEN["started"] = SEEN["started"] or time.perf_counter()
    response = case.call(base_url=fuzz_server.url, timeout=60)
    SEEN["requests"] += 1
    SEEN["statuses"][response.status_code] = SEEN["statuses"].get(response.status_code, 0) + 1
    case.validate_response(response, checks=CHECKS, additional_checks=[no_traceback])
    if response.status_code >= 400:  # every refusal says what is wrong: OpenAI's body on /v1/*, else {"error": "..."}
        error = response.json()["error"]
        message = error["message"] if case.path.startswith("/v1/") else error
        assert isinstance(message, str) and message, response.text


def test_server_survived_the_fuzzing_and_still_generates(fuzz_server):
    seconds = time.perf_counter() - SEEN["started"] if SEEN["started"] else 0.0
    print(f"\nfuzz: {SEEN['requests']} requests in {seconds:.0f} s, statuses {dict(sorted(SEEN['statuses'].items()))}")
    assert SEEN["requests"] >= 9 * 10, "the fuzzer ran (run this module whole)"
    assert fuzz_server.proc.poll() is None, "the server process died"
    response = httpx.post(fuzz_server.url + "/", json={"inputs": "still here", "parameters": {"seed": 1}},
                          headers={"lora": "style"}, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
    assert fuzz_server.metric("loraswap_requests_total", '{route="/",status="500"}') == 0
    assert "Traceback" not in fuzz_server.log(), "an unexpected error was logged"
