"""Building a KV transport by name."""

import os
import subprocess
import sys


def test_the_ucx_environment_is_set_when_a_transport_is_built_not_at_import():
    """In a fresh process: importing m3sdk (its client and node included) sets no UCX variable; building the
    default transport through TRANSPORTS sets them."""
    code = ("import os, m3sdk, m3sdk.disagg.client, m3sdk.node; assert 'UCX_MEMTYPE_CACHE' not in os.environ; "
            "from m3sdk.disagg.transport import build_transport; t = build_transport(); "
            "print(type(t).__name__, os.environ['UCX_MEMTYPE_CACHE'], os.environ['UCXPY_ENABLE_PYTHON_FUTURE'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_MEMTYPE", "UCXPY_ENABLE"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["UcxTransport", "n", "1"]
