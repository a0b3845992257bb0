"""What of a request's path a log line shows: never a query string, whether it comes as one or
%-encoded into the path (once or more), nor a URL's user and password, and no character that
would break the log line."""

import logging
from urllib.parse import quote

import pytest

from loraswap.server.access_log import HideQuery, loggable_path

SIGNED = "http%3A%2F%2F127.0.0.1%3A18080%2Fa.safetensors%3FX-Amz-Signature%3DSECRET"


@pytest.mark.parametrize("path,shown", [
    (f"/adapters/{SIGNED}/load", "/adapters/http://127.0.0.1:18080/a.safetensors?(query hidden)"),
    (f"/adapters/{SIGNED}", "/adapters/http://127.0.0.1:18080/a.safetensors?(query hidden)"),
    (f"/models/{SIGNED}", "/models/http://127.0.0.1:18080/a.safetensors?(query hidden)"),
    ("/adapters/http://127.0.0.1:18080/a.safetensors?X-Amz-Signature=SECRET/load",  # decoded, as the app logs it
     "/adapters/http://127.0.0.1:18080/a.safetensors?(query hidden)"),
    (f"/adapters/{SIGNED.replace('%', '%25')}/load", "/adapters/http://127.0.0.1:18080/a.safetensors?(query hidden)"),
    ("/adapters/a%25252525253FSECRET", "/adapters/a?(query hidden)"),  # encoded past what is decoded
    ("/v1/videos/video_1/content?variant=thumbnail&api_key=SECRET", "/v1/videos/video_1/content?(query hidden)"),
    ("/models/https%3A%2F%2Fuser%3ASECRET%40h.example%2Fa.safetensors", "/models/https://h.example/a.safetensors"),
    ("/adapters/a%0D%0Afake%20line", "/adapters/a%0D%0Afake%20line"),
    ("/", "/"),
])
def test_a_path_is_logged_without_its_secrets(path, shown):
    assert loggable_path(path) == shown
    assert loggable_path(quote(path)) == shown, "as uvicorn hands it over: the decoded path quoted again"


def test_the_access_record_is_rewritten():
    # uvicorn's: '%s - "%s %s HTTP/%s" %d', its path the decoded path quoted again
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", quote(f"/adapters/{SIGNED}/load".replace("%3F", "?")), "1.1",
                                403), None)
    assert HideQuery().filter(record)
    message = record.getMessage()
    assert "SECRET" not in message and "Signature" not in message
    assert message == '127.0.0.1:5 - "POST /adapters/http://127.0.0.1:18080/a.safetensors?(query hidden) HTTP/1.1" 403'
