"""The message of an error answer, read from the body its route answers with: OpenAI's
`{"error": {"message", "type", "param", "code"}}` on `/v1/*`, `{"error": "..."}` elsewhere,
each checked whole."""

OPENAI_FIELDS = {"message", "type", "param", "code"}
OPENAI_TYPES = ("invalid_request_error", "server_error")


def error_message(response) -> str:
    """The message of `response` (an httpx response, a TestClient's too), its body checked to be
    the shape its route answers with."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    if response.request.url.path.startswith("/v1/"):
        error = body["error"]
        assert isinstance(error, dict) and set(error) == OPENAI_FIELDS, body
        assert error["type"] == OPENAI_TYPES[response.status_code >= 500], body
        assert isinstance(error["message"], str) and error["message"], body
        return error["message"]
    assert isinstance(body["error"], str), body
    return body["error"]
