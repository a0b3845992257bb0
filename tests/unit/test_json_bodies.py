"""A request body's JSON nesting is limited by the server itself, not by the interpreter's
recursion limit (which torch.compile's Inductor raises to 2,000 when it first compiles)."""

import json
import sys

import pytest

from loraswap.errors import BadRequest
from loraswap.server.requests.parse import MAX_JSON_NESTING, parse_json
from loraswap.server.requests.schemas import HFRequest


def nested(depth: int) -> bytes:
    return json.dumps({"inputs": "a fox", "parameters": {"extra": json.loads("[" * (depth - 2) + "]" * (depth - 2))}})\
        .encode()


@pytest.mark.parametrize("recursion_limit", [1000, 2000])
def test_a_body_nested_past_the_limit_is_refused_whatever_the_recursion_limit(recursion_limit):
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)
    try:
        assert parse_json(nested(MAX_JSON_NESTING), HFRequest, 1 << 20)["parameters"]["extra"] is not None
        for body in (nested(MAX_JSON_NESTING + 1), b"[" * 1500 + b"]" * 1500):
            with pytest.raises(BadRequest, match="nested too deep"):
                parse_json(body, HFRequest, 1 << 20)
    finally:
        sys.setrecursionlimit(previous)
