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


def test_a_release_that_cannot_build_an_entry_gets_the_one_that_builds(monkeypatch):
    """`arch.TRITON_LIMITS`: below the release that builds a table entry, `tiles` hands out the replacement (the MX
    formats' entry only: bf16's and fp8's variants keep theirs); from that release on, the table's own."""
    from m3sdk_kernels import arch

    gfx942 = arch.ARCHS["gfx942"]
    monkeypatch.setattr(arch, "triton_version", lambda: (3, 6))
    assert arch.tiles("moe_small", gfx942)["DN_BLOCK_K"] == 128
    assert arch.tiles("moe_prefill", gfx942)["BLOCK_M"] == 64
    assert arch.tiles("moe_prefill", gfx942, "fp8")["BLOCK_M"] == arch.TILES["moe_prefill"]["gfx942"]["BLOCK_M"]
    assert arch.triton_limit("moe_small", arch.ARCHS["sm90"]) is None
    monkeypatch.setattr(arch, "triton_version", lambda: (3, 9))
    assert arch.tiles("moe_small", gfx942)["DN_BLOCK_K"] == arch.TILES["moe_small"]["gfx942"]["DN_BLOCK_K"] == 64
