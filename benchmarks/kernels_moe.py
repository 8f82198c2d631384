"""Fused MoE at MiniMax-M3 shapes (128 experts top-4 + the shared expert, 6144 -> 2x3072 -> 6144) on one GPU.

    PYTHONPATH=src python benchmarks/kernels_moe.py [--json PATH] [--jsonl PATH] [--sweep] [--formats F,..]
        [--prefill-formats F,..]

Ours (`fused_moe`, shared expert stacked as expert 128, router weights x 2.0) in bf16, FP8 (W8A8), MXFP4 and MXFP8
(`mxfp4` runs the table's path; `mxfp4:fp8` forces the fp8 tensor cores (MX_FP8), `mxfp4:dot_scaled` forces
`tl.dot_scaled`, `mxfp4:planes` runs the experts converted to the planes layout at load)
vs `torch._grouped_mm` in bf16 doing the same work (sort pairs by expert, gate_up grouped GEMM, SwiGLU-OAI, down
grouped GEMM, weight, sum), same routing (each token: 4 distinct random experts + the shared one).
Floor, decode: the bytes of the experts actually touched (each once, in the arm's format, scales included) over
the read bandwidth measured here; prefill: FLOPs over the bf16 / fp8 matmul rate measured here.
`--sweep` first times a few decode / small-batch tile configs and keeps the fastest (printed; copy to arch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import nullcontext

import torch
from gpu_timing import bench, read_bandwidth

from m3sdk_kernels.arch import TILES, current_arch
from m3sdk_kernels.experts import Experts, quantize_experts, to_planes
from m3sdk_kernels.moe import fused_moe, h_row, mx_fp8
from m3sdk_kernels.mx_convert import mx_to_fp8
from m3sdk_kernels.reference import fused_moe_ref

DEV = "cuda"
E, H, I, TOP_K, SCALE = 128, 6144, 3072, 4, 2.0
ALPHA, LIMIT = 1.702, 7.0
DECODE_T = (1, 4, 16, 64)
PREFILL_T = 8192
REP = 100  # ms of graph replays per timing sample (--rep)
SWEEP = {
    "moe_decode": [dict(GU_BLOCK_N=64, GU_BLOCK_K=128, DN_BLOCK_N=64, DN_BLOCK_K=128, num_stages=4),
                   dict(GU_BLOCK_N=32, GU_BLOCK_K=256, DN_BLOCK_N=32, DN_BLOCK_K=256, num_stages=3),
                   dict(GU_BLOCK_N=64, GU_BLOCK_K=256, DN_BLOCK_N=64, DN_BLOCK_K=256, num_stages=3)],
    "moe_small": [dict(GU_BLOCK_N=64, GU_BLOCK_K=128, DN_BLOCK_N=64, DN_BLOCK_K=64, num_stages=4),
                  dict(GU_BLOCK_N=32, GU_BLOCK_K=256, DN_BLOCK_N=64, DN_BLOCK_K=128, num_stages=3)],
}
# `--planes-sweep`: MXFP4 planes tiles, the same config for moe_decode:planes and moe_small:planes, every decode T
# (DECODE_MAX_TOKENS: moe_decode:planes's MAX_TOKENS only; 0 sends T = 1, 2 down the sorted path too, whose down GEMM
# has a program per (expert, column block) rather than per (token, column block))
PLANES_SWEEP = [dict(PLANES_SWAP=1, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=3),
                dict(PLANES_SWAP=1, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=2),
                dict(PLANES_SWAP=1, GU_BLOCK_N=128, DN_BLOCK_N=128, num_warps=8, num_stages=3),
                dict(PLANES_SWAP=0, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=3),
                dict(PLANES_SWAP=0, GU_BLOCK_N=32, DN_BLOCK_N=32, num_warps=4, num_stages=3),
                dict(PLANES_SWAP=0, GU_BLOCK_N=16, DN_BLOCK_N=16, num_warps=2, num_stages=3),
                dict(PLANES_SWAP=1, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=3, DECODE_MAX_TOKENS=0),
                dict(PLANES_SWAP=1, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=3, PLANES_XPERM=1),
                dict(PLANES_SWAP=1, GU_BLOCK_N=64, DN_BLOCK_N=64, num_warps=4, num_stages=4, PLANES_XPERM=1),
                dict(PLANES_SWAP=1, GU_BLOCK_N=128, DN_BLOCK_N=128, num_warps=8, num_stages=3, PLANES_XPERM=1)]
# `--prefill-sweep`: moe_prefill (8K tokens) for the --prefill-formats arms: the kept tiles first, then the fp8
# intermediate per row (H_ROW: the down GEMM's MMAs chain over K tiles of 128), gate|up as one interleaved MMA
# (FUSED_GU), MXFP4 converted to fp8 once per step (MX_CONVERT) instead of per token tile (2: the down weights on a
# side stream, overlapping the gate_up GEMM)
_P = dict(FUSED_GU=0, H_ROW=0, MX_CONVERT=0, GU_BLOCK_N=64, GU_BLOCK_K=64, DN_BLOCK_K=64, num_stages=3)
PREFILL_SWEEP = [dict(_P),
                 dict(_P, H_ROW=1, DN_BLOCK_K=128),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128, MX_CONVERT=1),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128, MX_CONVERT=1, num_stages=4),
                 dict(_P, H_ROW=1, DN_BLOCK_K=128, MX_CONVERT=1),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128, MX_CONVERT=1, GU_BLOCK_N=128),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128, MX_CONVERT=1, DN_BLOCK_N=256),
                 dict(_P, FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128, MX_CONVERT=2)]
# `--bf16-prefill-sweep`: moe_prefill:bf16 (8K tokens, bf16 experts): the kept tiles first (
# gate|up as one 256-wide interleaved MMA, 256-wide down tiles; before: two 64-wide gate / up MMAs, 128-wide down),
# then 4 stages, 64-row blocks (less padding per expert: ~317 pairs each at 8K tokens), K tiles of 128 at 2 stages
_B = dict(FUSED_GU=1, GU_BLOCK_N=128, GU_BLOCK_K=64, DN_BLOCK_N=256, DN_BLOCK_K=64, BLOCK_M=128, num_warps=8,
          num_stages=3)
BF16_PREFILL_SWEEP = [dict(_B),
                      dict(_B, num_stages=4),
                      dict(_B, BLOCK_M=64, num_warps=4),
                      dict(_B, GU_BLOCK_K=128, DN_BLOCK_K=128, num_stages=2)]
# `--convert-sweep`: mx_to_fp8 tiles (the whole 129-expert stack, both layouts)
CONVERT_SWEEP = [dict(BLOCK_N=32, num_warps=4), dict(BLOCK_N=64, num_warps=4), dict(BLOCK_N=32, num_warps=8)]


def mm_rate(dtype: torch.dtype) -> float:
    a = torch.randn(8192, 8192, device=DEV).to(dtype)
    b = torch.randn(8192, 8192, device=DEV).to(dtype)
    if dtype == torch.bfloat16:
        t = bench(lambda: a @ b.T, REP)
    else:
        one = torch.ones(1, device=DEV)
        t = bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16), REP)
    return 2 * 8192**3 / t / 1e9


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.rand(t, E, generator=g, device=DEV).argsort(-1)[:, :TOP_K].to(torch.int32)
    w = torch.rand(t, TOP_K, generator=g, device=DEV)
    w = w / w.sum(-1, keepdim=True) * SCALE
    return (torch.cat((w, torch.ones(t, 1, device=DEV)), 1),
            torch.cat((ids, torch.full((t, 1), E, dtype=torch.int32, device=DEV)), 1))


def expert_bytes(ex: Experts, touched: int) -> int:
    per = sum(t[0].numel() * t.element_size() for t in (ex.gate_up, ex.down))
    per += sum(t[0].numel() * t.element_size() for t in (ex.gate_up_scale, ex.down_scale, ex.gate_up_row, ex.down_row)
               if t is not None)
    return per * touched


def grouped_mm_moe(x, ids, w, w_gate_up_t, w_down_t):
    """The peer: torch._grouped_mm in bf16 over pairs sorted by expert (w_*_t: [E, K, N] views). No host sync,
    so it is graph-replayed like ours."""
    t, k = ids.shape
    sorted_ids, order = ids.reshape(-1).sort()
    groups = torch.arange(w_gate_up_t.shape[0], device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, groups, right=True).to(torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, w_gate_up_t, offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    gate = gate.clamp(max=LIMIT)
    h = (up.clamp(-LIMIT, LIMIT) + 1) * (gate * torch.sigmoid(ALPHA * gate))
    y = torch._grouped_mm(h, w_down_t, offs=offs) * w.reshape(-1)[order, None].to(h.dtype)
    out = torch.zeros(t * k, x.shape[1], device=x.device, dtype=y.dtype)
    out[order] = y
    return out.view(t, k, -1).sum(1)


class forced_mx_fp8:
    """The tile tables' MX_FP8 set to `value` in every MoE family inside the block."""

    def __init__(self, value: int):
        self.value = value

    def __enter__(self):
        self.saved = {f: TILES[f][current_arch().name].get("MX_FP8", 0) for f in ("moe_decode", "moe_small",
                                                                                   "moe_prefill")}
        for f in self.saved:
            TILES[f][current_arch().name]["MX_FP8"] = self.value

    def __exit__(self, *exc):
        for f, v in self.saved.items():
            TILES[f][current_arch().name]["MX_FP8"] = v


FORCED = {"dot_scaled": 0, "fp8": 1}


def arm_mx_fp8(arm: str, t: int) -> bool:
    """Whether arm `arm` ("fmt" or "fmt:path") runs MXFP4 through the fp8 tensor cores at `t` tokens."""
    fmt, _, path = arm.partition(":")
    with forced_mx_fp8(FORCED[path]) if path in FORCED else nullcontext():
        return mx_fp8(fmt, t, current_arch(), planes=path == "planes")


def arm_h_row(arm: str, t: int) -> bool:
    """Whether arm `arm` quantizes its fp8 intermediate per row at `t` tokens (the reference's h_row)."""
    fmt, _, path = arm.partition(":")
    with forced_mx_fp8(FORCED[path]) if path in FORCED else nullcontext():
        return h_row(fmt, t, current_arch(), planes=path == "planes")


def prefill_sweep(experts: dict, arms: list[str], jsonl: str | None, family: str = "moe_prefill:fp8",
                  configs: list[dict] = PREFILL_SWEEP) -> None:
    """Time `configs` at 8K tokens for `arms` (each config checked per arm at 300 tokens first); keep the config
    with the smallest sum over the arms in the `family` table."""
    table = TILES[family].setdefault(current_arch().name, {})
    base = dict(table)
    w, ids = routing(PREFILL_T, PREFILL_T)
    x = torch.randn(PREFILL_T, H, device=DEV, dtype=torch.bfloat16)
    defaults = _B if family == "moe_prefill:bf16" else _P
    best = None
    for cfg in configs:
        table.update(cfg)
        rec = dict(bench="moe_prefill_sweep", config=cfg, table=dict(table), us={}, rel_err={})
        try:
            for arm in arms:
                rec["rel_err"][arm] = check(arm, experts[arm], ts=(300,))
                rec["us"][arm] = bench(lambda arm=arm: run(arm, x, ids, w, experts[arm]), REP) * 1e3
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        changed = {k: v for k, v in cfg.items() if defaults.get(k) != v}
        print(f"prefill sweep {changed}: " + (rec.get("error", "")[:200] or
              " ".join(f"{a} {v:.0f}" for a, v in rec["us"].items()) + " us"), flush=True)
        if jsonl:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        if "error" not in rec and (best is None or sum(rec["us"].values()) < best[0]):
            best = (sum(rec["us"].values()), cfg)
        table.clear()
        table.update(base)
    if best is not None:
        table.update(best[1])
    print(f"prefill sweep: keep {best[1] if best else None}")


def convert_sweep(stacks: dict, jsonl: str | None) -> None:
    """Time `mx_to_fp8` of the whole stack (checkpoint and planes layouts) for CONVERT_SWEEP: ms and TB/s moved
    (MXFP4 bytes read + fp8 bytes and row scales written); keep the config fastest on their sum."""
    table = TILES["mx_to_fp8"][current_arch().name]
    base, best = dict(table), None
    for cfg in CONVERT_SWEEP:
        table.update(cfg)
        rec = dict(bench="mx_to_fp8", config=cfg, ms={}, tbps={})
        for name in ("mxfp4", "planes"):
            if name in stacks:
                ex = stacks[name]
                # read the stack, write one fp8 byte per weight (32 per scale group)
                moved = expert_bytes(ex, ex.num_experts) + 32 * (ex.gate_up_scale.numel() + ex.down_scale.numel())
                rec["ms"][name] = bench(lambda ex=ex: mx_to_fp8(ex), REP)
                rec["tbps"][name] = moved / rec["ms"][name] / 1e9
        print(f"convert sweep {cfg}: " + " ".join(f"{n} {v:.2f} ms ({rec['tbps'][n]:.2f} TB/s)"
                                                  for n, v in rec["ms"].items()), flush=True)
        if jsonl:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        if best is None or sum(rec["ms"].values()) < best[0]:
            best = (sum(rec["ms"].values()), cfg)
        table.clear()
        table.update(base)
    table.update(best[1])
    print(f"convert sweep: keep {best[1]}")


def run(arm: str, x, ids, w, ex: Experts) -> torch.Tensor:
    path = arm.partition(":")[2]
    with forced_mx_fp8(FORCED[path]) if path in FORCED else nullcontext():
        return fused_moe(x, ids, w, ex, ALPHA, LIMIT)


def planes_sweep(ex: Experts, jsonl: str | None, peer) -> None:
    """Time PLANES_SWEEP at every decode T (each config checked against the reference first; `peer(x, ids, w)` is
    timed once per T beside them); keep the config with the smallest sum over T in both planes tables."""
    arch = current_arch().name
    tables = [TILES[f].setdefault(arch, {}) for f in ("moe_decode:planes", "moe_small:planes")]
    base = [dict(t) for t in tables]
    best = None
    peer_us = {}
    for t in DECODE_T:
        w, ids = routing(t, t)
        x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
        peer_us[t] = bench(lambda x=x, ids=ids, w=w: peer(x, ids, w), REP) * 1e3
    print("planes sweep: grouped_mm " + " ".join(f"T={t} {v:.1f}" for t, v in peer_us.items()) + " us", flush=True)
    for cfg in PLANES_SWEEP:
        for t in tables:
            t.update({k: v for k, v in cfg.items() if k != "DECODE_MAX_TOKENS"})
        if "DECODE_MAX_TOKENS" in cfg:
            tables[0]["MAX_TOKENS"] = cfg["DECODE_MAX_TOKENS"]
        rec = dict(bench="moe_planes_sweep", config=cfg, tables=[dict(t) for t in tables], us={},
                   grouped_mm_us=peer_us)
        try:
            rec["rel_err"] = check("mxfp4:planes", ex, ts=(2, 40))
            for t in DECODE_T:
                w, ids = routing(t, t)
                x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
                rec["us"][t] = bench(lambda x=x, ids=ids, w=w: fused_moe(x, ids, w, ex, ALPHA, LIMIT), REP) * 1e3
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(f"planes sweep {cfg}: " + (rec.get("error", "")[:200] or " ".join(
            f"T={t} {v:.1f}" for t, v in rec["us"].items()) + f" us | err {rec['rel_err']:.1e}"), flush=True)
        if jsonl:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        if "error" not in rec and (best is None or sum(rec["us"].values()) < best[0]):
            best = (sum(rec["us"].values()), cfg)
        for t, b in zip(tables, base, strict=True):
            t.clear()
            t.update(b)
    if best is not None:
        for t in tables:
            t.update({k: v for k, v in best[1].items() if k != "DECODE_MAX_TOKENS"})
        if "DECODE_MAX_TOKENS" in best[1]:
            tables[0]["MAX_TOKENS"] = best[1]["DECODE_MAX_TOKENS"]
    print(f"planes sweep: keep {best[1] if best else None}")


def check(arm: str, ex: Experts, ts: tuple[int, ...] = (2, 40, 300)) -> float:
    """GPU kernel vs reference on a 4-expert slice at full width: decode (sort-free) and both sorted paths."""
    small = dataclasses.replace(ex, **{f.name: getattr(ex, f.name)[:4] for f in dataclasses.fields(ex)
                                       if isinstance(getattr(ex, f.name), torch.Tensor)})
    worst = 0.0
    for t in ts:
        g = torch.Generator(device=DEV).manual_seed(t)
        ids = torch.rand(t, 4, generator=g, device=DEV).argsort(-1)[:, :2].to(torch.int32)
        w = torch.rand(t, 2, generator=g, device=DEV)
        x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
        ref = fused_moe_ref(x, ids, w, small, ALPHA, LIMIT, mx_fp8=arm_mx_fp8(arm, t), h_row=arm_h_row(arm, t)).float()
        out = run(arm, x, ids, w, small).float()
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    assert worst < 2e-2, (arm, worst)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--jsonl", help="append one line per T")
    ap.add_argument("--formats", default="bf16,fp8,mxfp4:dot_scaled,mxfp4:fp8,mxfp8")
    ap.add_argument("--prefill-formats", help="the arms timed at 8K tokens (default: --formats)")
    ap.add_argument("--ts", default=",".join(map(str, (*DECODE_T, PREFILL_T))), help="token counts of the table")
    ap.add_argument("--rep", type=int, default=100, help="ms of graph replays per timing sample")
    ap.add_argument("--prefill-sweep", nargs="?", const="all", help="sweep the moe_prefill tiles first (8K tokens,"
                    " the --prefill-formats arms; a value: the PREFILL_SWEEP indices to time)")
    ap.add_argument("--bf16-prefill-sweep", nargs="?", const="all", help="sweep the moe_prefill:bf16 tiles first "
                    "(8K tokens, bf16 experts; a value: the BF16_PREFILL_SWEEP indices to time)")
    ap.add_argument("--convert-sweep", action="store_true", help="time mx_to_fp8 tiles first (the MXFP4 stacks)")
    ap.add_argument("--check-ts", default="2,40,300", help="token counts of the correctness check")
    ap.add_argument("--planes-sweep", nargs="?", const="all", help="sweep the planes tiles first (needs mxfp4:planes;"
                    " a value: the PLANES_SWEEP indices to time, e.g. 0,3)")
    args = ap.parse_args()
    global REP
    REP = args.rep
    ts = [int(t) for t in args.ts.split(",")]
    arch = current_arch()
    bw = read_bandwidth()
    # the matmul rates set the prefill floors only
    rate_bf16, rate_fp8 = (mm_rate(torch.bfloat16), mm_rate(arch.fp8_dtype)) if max(ts) > 256 else (1e9, 1e9)
    print(f"read bandwidth {bw:.0f} GB/s; matmul bf16 {rate_bf16:.0f}, fp8 {rate_fp8:.0f} TFLOP/s")

    torch.manual_seed(0)
    w_gate_up = torch.randn(E + 1, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E + 1, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    gu_t, dn_t = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    formats = args.formats.split(",")
    prefill_formats = args.prefill_formats.split(",") if args.prefill_formats else formats
    stacks = {f.split(":")[0]: None for f in formats}
    stacks = {f: quantize_experts(w_gate_up, w_down, f) for f in stacks}
    if "mxfp4:planes" in formats:
        stacks["planes"] = to_planes(stacks["mxfp4"] if "mxfp4" in stacks else quantize_experts(w_gate_up, w_down,
                                                                                              "mxfp4"))
    experts = {f: stacks["planes" if f == "mxfp4:planes" else f.split(":")[0]] for f in formats}
    for f, ex in list(experts.items()):
        try:  # an arm that fails its check (or does not compile) is reported and not timed; the others still are
            err = check(f, ex, tuple(int(t) for t in args.check_ts.split(",")))
            print(f"correctness {f}: rel err vs reference {err:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"correctness {f}: FAILED, not timed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            del experts[f]
            if args.jsonl:
                with open(args.jsonl, "a") as fh:
                    fh.write(json.dumps(dict(bench="moe", arm=f, error=f"{type(e).__name__}: {str(e)[:2000]}")) + "\n")

    if args.planes_sweep and "mxfp4:planes" in experts:
        if args.planes_sweep != "all":
            PLANES_SWEEP[:] = [PLANES_SWEEP[int(i)] for i in args.planes_sweep.split(",")]
        planes_sweep(experts["mxfp4:planes"], args.jsonl, lambda x, ids, w: grouped_mm_moe(x, ids, w, gu_t, dn_t))
    if args.convert_sweep:
        convert_sweep(stacks, args.jsonl)
    if args.prefill_sweep:
        if args.prefill_sweep != "all":
            PREFILL_SWEEP[:] = [PREFILL_SWEEP[int(i)] for i in args.prefill_sweep.split(",")]
        # the fp8 and MX arms (planes run the same fp8 kernels once converted; bf16 is timed in the table)
        prefill_sweep(experts, [f for f in prefill_formats if f in experts and f not in ("mxfp4:planes", "bf16")],
                      args.jsonl)
    if args.bf16_prefill_sweep and "bf16" in experts:
        if args.bf16_prefill_sweep != "all":
            BF16_PREFILL_SWEEP[:] = [BF16_PREFILL_SWEEP[int(i)] for i in args.bf16_prefill_sweep.split(",")]
        prefill_sweep(experts, ["bf16"], args.jsonl, "moe_prefill:bf16", BF16_PREFILL_SWEEP)
    if args.sweep:
        for fam, configs in SWEEP.items():
            t = 1 if fam == "moe_decode" else 16
            w, ids = routing(t, 99)
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            base = dict(TILES[fam][arch.name])
            for f in ("bf16", "fp8", "mxfp4"):
                for cfg in configs:
                    TILES[fam][arch.name].update(cfg)
                    ms = bench(lambda x=x, ids=ids, w=w, f=f: fused_moe(x, ids, w, experts[f], ALPHA, LIMIT), REP)
                    print(f"sweep {fam} T={t} {f} {cfg}: {ms * 1e3:.1f} us")
                    TILES[fam][arch.name].clear()
                    TILES[fam][arch.name].update(base)
        # the sort-free path against the sorted one at the edge
        for t in (4, 8, 16):
            w, ids = routing(t, 7)
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            for max_tokens in (t, t - 1):
                TILES["moe_decode"][arch.name]["MAX_TOKENS"] = max_tokens
                ms = bench(lambda x=x, ids=ids, w=w: fused_moe(x, ids, w, experts["bf16"], ALPHA, LIMIT), REP)
                print(f"sweep T={t} {'sort-free' if max_tokens == t else 'sorted'}: {ms * 1e3:.1f} us")
        TILES["moe_decode"][arch.name]["MAX_TOKENS"] = 2

    rows = []
    for t in ts:
        w, ids = routing(t, t)
        x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
        touched = ids.unique().numel()
        peer = bench(lambda x=x, ids=ids, w=w: grouped_mm_moe(x, ids, w, gu_t, dn_t), REP)
        flops = 6 * H * I * ids.numel()
        row = dict(bench="moe", T=t, experts_touched=touched, grouped_mm_ms=peer)
        for f, ex in experts.items():
            if t == PREFILL_T and f not in prefill_formats:
                continue
            ms = bench(lambda x=x, ids=ids, w=w, ex=ex, f=f: run(f, x, ids, w, ex), REP)
            byts = expert_bytes(ex, touched)
            fp8_mma = f == "fp8" or arm_mx_fp8(f, t)
            floor = max(byts / bw / 1e6, flops / (rate_fp8 if fp8_mma else rate_bf16) / 1e9)
            row[f] = dict(ms=ms, floor_ms=floor, gbps=byts / ms / 1e6, tflops=flops / ms / 1e9,
                          vs_grouped_mm=peer / ms)
        rows.append(row)
        if args.jsonl:
            with open(args.jsonl, "a") as fh:
                fh.write(json.dumps(dict(row, read_gbps=bw, bf16_tflops=rate_bf16, fp8_tflops=rate_fp8)) + "\n")
        print(f"T={t:5} experts {touched:3}  grouped_mm {peer * 1e3:9.1f} us  " + "  ".join(
            f"{f} {row[f]['ms'] * 1e3:8.1f} us ({row[f]['vs_grouped_mm']:.2f}x, floor {row[f]['floor_ms'] * 1e3:.1f})"
            for f in experts if f in row), flush=True)

    print("\n| T | experts touched | grouped_mm bf16 (us) | " + " | ".join(
        f"{f} (us) | {f} floor (us) | {f} vs grouped_mm" for f in experts) + " |")
    print("|---|---|---|" + "---|---|---|" * len(experts))
    for r in rows:
        print(f"| {r['T']} | {r['experts_touched']} | {r['grouped_mm_ms'] * 1e3:.1f} | " + " | ".join(
            f"{r[f]['ms'] * 1e3:.1f} | {r[f]['floor_ms'] * 1e3:.1f} | {r[f]['vs_grouped_mm']:.2f}x" if f in r
            else "- | - | -" for f in experts) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(read_gbps=bw, bf16_tflops=rate_bf16, fp8_tflops=rate_fp8,
                           tiles={k: TILES[k][arch.name] for k in ("moe_decode", "moe_small", "moe_prefill",
                                                                     "moe_prefill:bf16")},
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
