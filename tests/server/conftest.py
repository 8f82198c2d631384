"""One `m3sdk serve` process on the bundled m3-tiny for the module's tests, reached over real HTTP."""

import pytest
from server_process import Server

API_KEY = "test-key"


@pytest.fixture(scope="package")
def server():
    """max_num_seqs 4 + max_waiting_requests 2: the seventh live request is refused (503)."""
    srv = Server("--api-key", API_KEY, "--max-num-seqs", "4", "--engine-arg", "max_waiting_requests=2",
                 "--served-model-name", "m3-tiny", "minimax-m3-tiny")
    yield srv
    out = srv.stop()
    assert "Traceback" not in out, out
