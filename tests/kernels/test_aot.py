"""CI's MI355X / MI300X readiness check: `python -m m3sdk_kernels.aot` compiles every kernel variant of every
module for gfx950 and gfx942 on this CPU machine and fails on a compile error or a spill."""

import json
import os
import subprocess
import sys

KEYS = {"name", "target", "ok", "registers", "spill_bytes", "shared_bytes", "matrix_instructions"}


def test_aot_compiles_every_variant_for_amd_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {t: subprocess.Popen([sys.executable, "-m", "m3sdk_kernels.aot", "--target", t, "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for t in ("gfx950", "gfx942")}  # the two targets compile side by side
    for target, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{target}: {err[-2000:]}"
        rows = json.loads(out)
        names = {r["name"] for r in rows}
        assert {"attention.dense_decode_fp8_shuffle", "attention.sparse_prefill_fp8_shuffle",
                "indexer.scan_decode_fp8", "indexer.topk", "cache_write.norm_rope_write_fp8_shuffle"} <= names
        for r in rows:
            assert KEYS <= set(r) and r["target"] == target
            assert r["ok"] and r["spill_bytes"] == 0 and r["registers"] > 0, r
            if r["name"].startswith(("attention.", "indexer.scan")) and r["name"] != "attention.merge":
                assert r["matrix_instructions"] > 0, r  # the dots became MFMA instructions
