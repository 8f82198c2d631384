"""A schemathesis contract check: requests generated from the server's own OpenAPI schema (a few per route) get
answers that the schema documents (status, content type, body shape) and never a 500."""

import pytest

schemathesis = pytest.importorskip("schemathesis")  # the test extra has it; a bare GPU host may not

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import Server  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def contract_server():
    """Its own server: a short context bounds what generated requests make the CPU generate."""
    srv = Server("--max-model-len", "48", "--max-num-seqs", "16")
    yield srv
    out = srv.stop()
    assert "Traceback" not in out, out


def test_the_server_keeps_its_contract(contract_server):
    schema = schemathesis.openapi.from_url(contract_server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "GET /metrics"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def keeps_contract(case):
            case.call_and_validate(base_url=contract_server.base, timeout=60, checks=CHECKS)

        keeps_contract()
