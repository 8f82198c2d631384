"""FP8 W8A8 GEMM (per-token activation quantization included) at MiniMax-M3 shapes: ours vs torch vs the floor.

    PYTHONPATH=src python benchmarks/kernels_gemm.py [--json PATH] [--jsonl PATH] [--sweep [FAMILY,..]] [--ms 1,16]
        [--arms ours,sep,gemm,norm,norm0,normq,swiglu,torch,bf16] [--rep MS] [--shapes PREFIX,..]
        [--sweep-shapes PREFIX,..] [--sweep-ms 1,16]

Shapes (K -> N): the packed q|k|v|index projection 6144 -> 9856, o_proj 8192 -> 6144, the dense MLP 6144 -> 24576
(gate|up) and 12288 -> 6144 (down); M = 1 .. 8192 tokens. Arms, same inputs:
- ours: `fp8_linear` on the bf16 activation, as the model calls it for o_proj: the per-token quantization launch +
  the GEMM (both launched as programmatic dependents where the tile table says PDL)
- sep: `quantize_fp8_per_token` (never PDL) + `fp8_gemm`; gemm: `fp8_gemm` alone on a quantized activation
- torch: per-token quantization in eager torch + `torch._scaled_mm` rowwise (CUTLASS), and `_scaled_mm` alone
- bf16 `torch.mm`: the "is FP8 worth it" bar
- the norm path: `add_rms_norm(..., fp8_dtype)` (residual add + norm + per-token quantization, one launch) +
  `fp8_gemm`, beside the bf16 `add_rms_norm` it replaces: their difference is what FP8 costs in front of the GEMM;
  norm0: the same with the norm launched plainly (its table's PDL off); normq: the bf16 `add_rms_norm` +
  `fp8_linear` on its output, i.e. quantization + GEMM behind a kernel that produces their input and knows nothing
  of PDL (the other arms rotate GEMMs back to back); swiglu (dense down): `swiglu_quantize_fp8` on a [M, 2K] gate_up
  output + `fp8_gemm`, the model's down path (the SwiGLU-OAI and the quantization in one launch)
Floor: max(weight + activation bytes / read bandwidth, FLOPs / the fp8 matmul rate measured by `_scaled_mm` at
8192^3). Decode shapes rotate 4 weight copies (> L2) so every call streams its weight from HBM.
`--sweep` times a few tile configs per M bucket first and keeps the fastest (printed; copy into arch.py); the decode
families (and `fp8_quant`, the quantization launch) are timed as `fp8_linear` on bf16 activations (quantization
included; the GEMM alone beside it) at each M of `--sweep-ms` on every shape they serve (`--sweep-shapes`) and kept
by the sum. `--arms` picks the timed columns (others print nan), `--rep` the ms of
graph replays per timing sample (10 samples each).
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_timing import bench, read_bandwidth

from m3sdk_kernels.arch import TILES, current_arch
from m3sdk_kernels.formats import quantize_fp8_weight
from m3sdk_kernels.norm import add_rms_norm
from m3sdk_kernels.quant import decode_variant, fp8_gemm, fp8_linear, quantize_fp8_per_token, swiglu_quantize_fp8
from m3sdk_kernels.reference import fp8_gemm_ref, fp8_linear_ref, swiglu_quantize_fp8_ref

DEV = "cuda"
SHAPES = {"qkv_index 6144->9856": (6144, 9856), "o_proj 8192->6144": (8192, 6144),
          "dense gate_up 6144->24576": (6144, 24576), "dense down 12288->6144": (12288, 6144)}
MS = (1, 16, 256, 1024, 8192)
ARMS = ("ours", "sep", "gemm", "norm", "norm0", "normq", "swiglu", "torch", "bf16")
# decode configs set every key they vary: swap-AB (64 weight rows x 16 tokens, fp8 wgmma), launched as programmatic
# dependents (PDL: the quantization and the GEMM start while the kernel before them finishes; the GEMM prefetches
# PREFETCH weight tiles into L2 before griddepcontrol.wait and lets the next kernel launch once its weight stream is
# done), the weight tiles by TMA. qkv+index (154 column blocks): split-K up to 264 programs (so
# none), 4 stages; o_proj / dense down (96 column blocks, `:narrow`): no split, 6 stages, against 5 / 7 / 8
# stages and the earlier default (split in 2, 4 stages). Also timed, split in 2: the last split waiting for
# the others and summing without publishing its own (o_proj 15.7 / 16.2 / 16.8 us at M = 1 / 4 / 16), no STAGGER,
# 8 warps, 2 tiles prefetched, cp.async: all 15.6-17.4 us; 8 warps at 3 / 4 stages, 5 stages, no prefetch,
# K tiles of 128 x 8 stages.
# Lost before (docs/perf.md): stream-K (equal ranges of (column block, K tile) units per
# program, 1-3 per SM: 0.5-3.5 us slower on every shape); the quantization inside the GEMM (every
# program computing the rows' scales: +1.3 us at M = 1, +9 us at M = 16), the activation by TMA too, 128-row tiles
# (the GEMM alone 0.2-0.9 us faster at M = 1, 1-2.5 us slower with the quantization launch in front); before: 330 /
# 396 programs, prefetch 4 / 8, unsplit 16-column tiles (mma.sync), the quantization inside the GEMM's launch.
_DECODE = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, STAGGER=1, SWAP_AB=1, SPLIT_PROGRAMS=264, PDL=1,
               PREFETCH=1, TMA=1)
_NARROW = dict(_DECODE, SPLIT_PROGRAMS=0, num_stages=6)
SWEEP = {
    "fp8_gemm_decode": [dict(_DECODE), dict(_DECODE, TMA=0), dict(_DECODE, num_stages=5)],
    "fp8_gemm_decode:narrow": [dict(_NARROW), dict(_NARROW, num_stages=5), dict(_NARROW, num_stages=7),
                               dict(_NARROW, num_stages=8), dict(_DECODE)],
    "fp8_gemm_decode:wide": [dict(_DECODE, num_stages=3), dict(_DECODE, TMA=0, num_stages=3)],
    # the activation quantization launch in front of the decode GEMM (`fp8_linear`, timed as the decode configs)
    "fp8_quant": [dict(num_warps=16), dict(num_warps=8), dict(num_warps=4)],
    "fp8_gemm_mid": [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
                     dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)],
    "fp8_gemm_prefill": [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
                         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
                         dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)],
}


def torch_quant(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(fp8).max
    return (x.float() / s).to(fp8), s


def torch_quant_ref(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch_quant(x, fp8)
    return q, s[:, 0]


def fp8_rate(fp8: torch.dtype) -> float:
    a = torch.randn(8192, 8192, device=DEV).to(fp8)
    b = torch.randn(8192, 8192, device=DEV).to(fp8)
    one = torch.ones(1, device=DEV)
    t = bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16))
    return 2 * 8192**3 / t / 1e9  # TFLOP/s


def measure(name: str, k: int, n: int, m: int, weights: list, wbf: torch.Tensor, fp8: torch.dtype, bw: float,
            rate: float, arms: set[str], rep: int) -> dict:
    """One (shape, M) row; each arm runs over the rotated weight copies and is divided by their count."""
    nan = float("nan")
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    xq, xs = quantize_fp8_per_token(x, fp8)

    def rotated(one) -> float:
        return bench(lambda: [one(w, s) for w, s in weights], rep) / len(weights)

    ours = rotated(lambda w, s: fp8_linear(x, w, s)) if "ours" in arms else nan
    sep = rotated(lambda w, s: fp8_gemm(*quantize_fp8_per_token(x, fp8), w, s)) if "sep" in arms else nan
    gemm = rotated(lambda w, s: fp8_gemm(xq, xs, w, s)) if "gemm" in arms else nan
    res, nw = torch.randn_like(x), torch.randn(k, device=DEV, dtype=torch.bfloat16) * 0.1

    def norm_gemm(w, s):
        y, ys, _ = add_rms_norm(x, nw, 1e-6, res, fp8)
        return fp8_gemm(y, ys, w, s)

    def norm_linear(w, s):
        y, _, _ = add_rms_norm(x, nw, 1e-6, res)
        return fp8_linear(y, w, s)

    swiglu = nan
    if "swiglu" in arms and name.startswith("dense down"):  # the model's down path: SwiGLU-OAI + quantization, GEMM
        gu = torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16) * 2

        def swiglu_gemm(w, s):
            return fp8_gemm(*swiglu_quantize_fp8(gu, 1.702, 7.0, fp8, pdl=True), w, s)

        swiglu = rotated(swiglu_gemm)
    fused = rotated(norm_gemm) if "norm" in arms else nan
    fused0 = nan
    if "norm0" in arms:  # the same with the norm launched plainly (not as a programmatic dependent)
        table = TILES["rms_norm"][current_arch().name]
        saved = table.get("PDL", 0)
        table["PDL"] = 0
        fused0 = rotated(norm_gemm)
        table["PDL"] = saved
    normq = rotated(norm_linear) if "normq" in arms else nan
    norm_bf16 = bench(lambda: add_rms_norm(x, nw, 1e-6, res), rep) if "norm" in arms or "normq" in arms else nan
    peer = peer_mm = nan
    try:  # cuBLAS/CUTLASS fp8 may refuse some shapes
        if "torch" in arms:
            peer = rotated(lambda w, s: torch._scaled_mm(*_quant_pair(x, fp8, w), s[None, :],
                                                         out_dtype=torch.bfloat16))
            peer_mm = rotated(lambda w, s: torch._scaled_mm(xq, w.T, xs[:, None], s[None, :],
                                                            out_dtype=torch.bfloat16))
    except RuntimeError as e:
        print(f"torch arm failed at M={m}: {str(e).splitlines()[0][:120]}")
    bf16 = bench(lambda: x @ wbf.T, rep) if "bf16" in arms else nan
    byts = n * k + m * k * 2 + m * n * 2
    floor = max(byts / bw / 1e6, 2 * m * n * k / rate / 1e9)  # ms
    return dict(bench="fp8_gemm", shape=name, M=m, ours_ms=ours, sep_ms=sep, gemm_ms=gemm, norm_fp8_gemm_ms=fused,
                norm_plain_fp8_gemm_ms=fused0, norm_bf16_linear_ms=normq, swiglu_fp8_gemm_ms=swiglu,
                norm_bf16_ms=norm_bf16, torch_ms=peer, scaled_mm_ms=peer_mm, bf16_ms=bf16, floor_ms=floor,
                weight_gbps=n * k / gemm / 1e6, tflops=2 * m * n * k / ours / 1e9)


def sweep(fam: str, arch, fp8: torch.dtype, rep: int, shapes: tuple[str, ...] = ("",),
          ms: tuple[int, ...] = (1, 16)) -> list[dict]:
    """Time SWEEP[fam] and keep the fastest in TILES (decode: `fp8_linear` on bf16 activations at each M of `ms` on
    every shape, by the sum, and the GEMM alone beside it; mid / prefill: the GEMM alone). Each config is checked
    before it is timed: against the reference, and at decode also bit for bit against `quantize_fp8_per_token` +
    `fp8_gemm` and against 8 more launches of its own (split-K / stream-K arrivals race on the GPU only); a config
    off the reference is reported and skipped. Returns one record per config."""
    decode = fam.startswith("fp8_gemm_decode") or fam == "fp8_quant"
    if decode:  # the shapes each decode table serves (the quantization: all)
        cases = [(shape, m) for shape, (_, n) in SHAPES.items() for m in ms if shape.startswith(shapes)
                 and (fam == "fp8_quant" or (decode_variant(n) or "") == fam.partition(":")[2])]
    else:
        cases = [("qkv_index 6144->9856", {"fp8_gemm_mid": 256, "fp8_gemm_prefill": 8192}[fam])]
    if not cases:
        return []
    data = {}
    for shape, m in cases:
        k, n = SHAPES[shape]
        if shape not in data:
            data[shape] = [quantize_fp8_weight(torch.randn(n, k, device=DEV) * 0.02, fp8) for _ in range(4)]
        data[shape, m] = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    base = dict(TILES[fam][arch.name])
    best, records = None, []
    for cfg in SWEEP[fam]:
        TILES[fam][arch.name].update(cfg)
        times, gemm_times, errs, same = [], [], [], True
        for shape, m in cases:
            x, ws_ = data[shape, m], data[shape]
            xq, xs = quantize_fp8_per_token(x, fp8)
            if decode:
                out = fp8_linear(x, *ws_[0])
                same &= torch.equal(out, fp8_gemm(xq, xs, *ws_[0]))
                same &= all(torch.equal(out, fp8_linear(x, *ws_[0])) for _ in range(8))
                ref = fp8_linear_ref(x, *ws_[0])
            else:
                out, ref = fp8_gemm(xq, xs, *ws_[0]), fp8_gemm_ref(xq, xs, *ws_[0])
            errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
            if errs[-1] >= 1e-2:
                break
            run = (lambda x=x, ws_=ws_: [fp8_linear(x, w, s) for w, s in ws_]) if decode else \
                (lambda xq=xq, xs=xs, ws_=ws_: [fp8_gemm(xq, xs, w, s) for w, s in ws_])
            times.append(bench(run, rep) / 4)
            if decode:
                gemm_times.append(bench(lambda xq=xq, xs=xs, ws_=ws_: [fp8_gemm(xq, xs, w, s) for w, s in ws_],
                                        rep) / 4)
        records.append(dict(bench="fp8_gemm_sweep", family=fam, config=dict(TILES[fam][arch.name]),
                            cases=[f"{s.split()[0]}/M{m}" for s, m in cases], us=[t * 1e3 for t in times],
                            gemm_us=[t * 1e3 for t in gemm_times], max_rel_err=max(errs), bitwise_as_separate=same))
        if max(errs) >= 1e-2 or not same:
            print(f"sweep {fam} {cfg}: FAIL rel err {max(errs):.2e} vs the reference, bit for bit {same}, skipped")
        else:
            print(f"sweep {fam} {cfg}: " + " ".join(f"{c} {t * 1e3:.1f}" for c, t in
                                                     zip(records[-1]["cases"], times, strict=True))
                  + f" | sum {sum(times) * 1e3:.1f} us"
                  + (" | gemm " + " ".join(f"{t * 1e3:.1f}" for t in gemm_times) if gemm_times else ""))
            if best is None or sum(times) < best[0]:
                best = (sum(times), dict(TILES[fam][arch.name]))
        TILES[fam][arch.name].clear()
        TILES[fam][arch.name].update(base)
    if best is not None:
        TILES[fam][arch.name].update(best[1])
    print(f"sweep {fam}: keep {TILES[fam][arch.name]}")
    return records


def _quant_pair(x: torch.Tensor, fp8: torch.dtype, w: torch.Tensor) -> tuple:
    q, qs = torch_quant(x, fp8)
    return q, w.T, qs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", nargs="?", const=",".join(SWEEP), default="",
                    help="tile families to sweep first (default with no value: all)")
    ap.add_argument("--jsonl", help="append one line per row")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M")
    ap.add_argument("--arms", default=",".join(ARMS), help="timed columns")
    ap.add_argument("--rep", type=int, default=100, help="ms of graph replays per timing sample")
    ap.add_argument("--shapes", help="only the shapes whose names start with one of these (comma-separated)")
    ap.add_argument("--sweep-shapes", default="", help="the decode sweep only on these shapes (name prefixes)")
    ap.add_argument("--sweep-ms", default="1,16", help="the decode sweep's token counts M")
    args = ap.parse_args()
    if args.shapes:
        for name in list(SHAPES):
            if not name.startswith(tuple(args.shapes.split(","))):
                del SHAPES[name]
    arch = current_arch()
    fp8 = arch.fp8_dtype
    bw = read_bandwidth()
    rate = fp8_rate(fp8)
    arms = set(args.arms.split(","))
    print(f"read bandwidth {bw:.0f} GB/s, fp8 _scaled_mm 8192^3 {rate:.0f} TFLOP/s")

    # the sweep first (it checks each config itself), then correctness of the kept tiles at real shapes (GPU dots,
    # not the interpreter's) before the timed table
    for fam in filter(None, args.sweep.split(",")):
        for rec in sweep(fam, arch, fp8, args.rep, tuple(args.sweep_shapes.split(",")),
                         tuple(map(int, args.sweep_ms.split(",")))):
            if args.jsonl:
                with open(args.jsonl, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
    for name, (k, n) in SHAPES.items():
        wq, ws = quantize_fp8_weight(torch.randn(n, k, device=DEV) * 0.02, fp8)
        for m in (1, 3, 16, 300):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = quantize_fp8_per_token(x, fp8)
            qr, sr = torch_quant_ref(x, fp8)
            assert torch.allclose(xs, sr, rtol=1e-6) and (xq.float() - qr.float()).abs().max() <= 32, (name, m)
            ref = fp8_gemm_ref(xq, xs, wq, ws)
            out = fp8_gemm(xq, xs, wq, ws)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, (name, m, err)
            # the model's entry on the bf16 activation (both launches PDL where the tiles say so): the same bits
            assert torch.equal(fp8_linear(x, wq, ws), out) and torch.equal(fp8_linear(x, wq, ws), out), (name, m)
        # the fused norm's fp8 output feeds the GEMM: against norm -> quantize -> GEMM in plain torch
        x, res = (torch.randn(16, k, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.randn(k, device=DEV, dtype=torch.bfloat16) * 0.1
        y, ys, _ = add_rms_norm(x, nw, 1e-6, res, fp8)
        hf = x.float() + res.float()
        ref = fp8_gemm_ref(*torch_quant_ref(hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
                                            * (1 + nw.float()), fp8), wq, ws)
        err = ((fp8_gemm(y, ys, wq, ws).float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, (name, "norm+gemm", err)
        # the SwiGLU-OAI + quantization launch against torch's bf16 ops (CUDA's sigmoid may round an element
        # differently: a few codes, never the scale by more than a bf16 step)
        gu = torch.randn(16, 2 * k, device=DEV, dtype=torch.bfloat16) * 3
        (q, s), (qr, sr) = (f(gu, 1.702, 7.0, fp8) for f in (swiglu_quantize_fp8, swiglu_quantize_fp8_ref))
        off = (q.float() != qr.float()).float().mean().item()
        assert (s / sr - 1).abs().max() < 1e-2 and off < 1e-2, (name, "swiglu", off)
    print("correctness: quantize_fp8_per_token == torch, fp8_gemm == fp8_gemm_ref at every shape, fp8_linear(bf16) "
          "== quantize + fp8_gemm bit for bit (twice); add_rms_norm(fp8) + fp8_gemm == torch; swiglu_quantize_fp8 == "
          "torch")

    rows = []
    for name, (k, n) in SHAPES.items():
        weights = [quantize_fp8_weight(torch.randn(n, k, device=DEV) * 0.02, fp8) for _ in range(4)]
        wbf = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        for m in map(int, args.ms.split(",")):
            rows.append(measure(name, k, n, m, weights, wbf, fp8, bw, rate, arms, args.rep))
            r = rows[-1]
            if args.jsonl:
                with open(args.jsonl, "a") as fh:
                    fh.write(json.dumps(dict(r, read_gbps=bw, fp8_tflops=rate,
                                             tiles={f: TILES[f][arch.name] for f in SWEEP})) + "\n")
            print(f"{name:28} M={m:5} ours {r['ours_ms'] * 1e3:8.1f} us (sep {r['sep_ms'] * 1e3:.1f}, gemm "
                  f"{r['gemm_ms'] * 1e3:.1f}, normq {r['norm_bf16_linear_ms'] * 1e3:.1f}, swiglu "
                  f"{r['swiglu_fp8_gemm_ms'] * 1e3:.1f}, norm+gemm "
                  f"{r['norm_fp8_gemm_ms'] * 1e3:.1f} / {r['norm_plain_fp8_gemm_ms'] * 1e3:.1f} vs bf16 norm "
                  f"{r['norm_bf16_ms'] * 1e3:.1f})  torch "
                  f"{r['torch_ms'] * 1e3:8.1f} (_scaled_mm {r['scaled_mm_ms'] * 1e3:8.1f})  bf16 "
                  f"{r['bf16_ms'] * 1e3:8.1f}  floor {r['floor_ms'] * 1e3:7.1f}")
    print("\n| shape | M | ours quant+gemm (us) | sep quant + gemm (us) | gemm only (us) | torch quant+_scaled_mm (us) "
          "| _scaled_mm (us) | bf16 mm (us) | floor (us) | torch/ours | floor/ours | floor/gemm | norm(fp8)+gemm (us) "
          "| bf16 norm (us) | floor/(norm+gemm-bf16 norm) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['M']} | {r['ours_ms'] * 1e3:.1f} | {r['sep_ms'] * 1e3:.1f} | "
              f"{r['gemm_ms'] * 1e3:.1f} | "
              f"{r['torch_ms'] * 1e3:.1f} | {r['scaled_mm_ms'] * 1e3:.1f} | {r['bf16_ms'] * 1e3:.1f} | "
              f"{r['floor_ms'] * 1e3:.1f} | {r['torch_ms'] / r['ours_ms']:.2f}x | {r['floor_ms'] / r['ours_ms']:.0%} | "
              f"{r['floor_ms'] / r['gemm_ms']:.0%} | {r['norm_fp8_gemm_ms'] * 1e3:.1f} | "
              f"{r['norm_bf16_ms'] * 1e3:.1f} | "
              f"{r['floor_ms'] / max(r['norm_fp8_gemm_ms'] - r['norm_bf16_ms'], 1e-9):.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(read_gbps=bw, fp8_tflops=rate, tiles={k: TILES[k][arch.name] for k in SWEEP}, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
