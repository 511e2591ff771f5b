"""The OpenAPI schema fuzzed with schemathesis (valid and invalid bodies) against a live server: never a 5xx."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.server.conftest import MODEL_NAME, LiveServer

MAX_EXAMPLES = 30


def _served_model(case):
    """Valid bodies name the served model, so that they reach the engine rather than stop at 404."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_NAME
    return case


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    """A short max_model_len bounds how long any generated request can run."""
    live = LiveServer(model_dir, max_model_len=32)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
    ("GET", "/ping"), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
])
def test_no_server_errors(fuzz_server, schema, method, path):
    operation = next(op for op in (r.ok() for r in schema.get_all_operations())
                     if op.path == path and op.method.upper() == method)
    valid = operation.as_strategy(schemathesis.GenerationMode.POSITIVE).map(_served_model)
    strategy = st.one_of(valid, operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])

    check()
    assert fuzz_server.async_engine.is_alive
