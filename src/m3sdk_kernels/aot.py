"""Ahead-of-time compile report: every kernel variant, every target, on a machine without a GPU.

    python -m m3sdk_kernels.aot --target gfx950 [--json]

Each kernel module listed in `KERNEL_MODULES` defines `aot_variants(arch) -> list[AotVariant]`: the kernels it
launches with the tile configs `arch.tiles` gives on that target, at the released model's shapes. This file
compiles them through `triton.compile` for the target and reads the resource report out of the output
(AMDGCN metadata on AMD, `ptxas -v` on NVIDIA). Exit status 1 on a compile error or a register spill.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import triton

from m3sdk_kernels.arch import ARCHS, TRITON_LIMITS, Arch, triton_limit

# Kernel modules contributing variants (append yours: a module with `aot_variants(arch)`).
KERNEL_MODULES: list[str] = [
    "m3sdk_kernels.cache_write",
    "m3sdk_kernels.paged_attention",
    "m3sdk_kernels.indexer",
    "m3sdk_kernels.router",
    "m3sdk_kernels.moe_align",
    "m3sdk_kernels.mx_convert",
    "m3sdk_kernels.moe",
    "m3sdk_kernels.quant",
    "m3sdk_kernels.norm",
    "m3sdk_kernels.vision_rope",
]


# The released MiniMax-M3's attention shapes: what the AOT report compiles for (a checkpoint's config decides
# the real values at run time; these only pick the constexprs of the compiled variants).
M3_SHAPES = {"num_heads": 64, "num_kv_heads": 4, "head_dim": 128, "index_heads": 4, "index_dim": 128,
             "rotary_half": 32, "block_size": 128, "topk": 16, "local_blocks": 1}


@dataclass(frozen=True)
class AotVariant:
    """One compiled configuration of a kernel.

    `types` gives the Triton type of every runtime argument ("*bf16", "*fp8e4nv", "i32", "i64", "fp32"...);
    arguments named in `constexprs` are compile-time constants. Pointers are assumed 16-byte aligned and the
    int arguments named in `aligned` divisible by 16, as the JIT would specialize them at run time."""

    name: str
    kernel: Any  # triton.runtime.JITFunction
    types: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    aligned: tuple[str, ...] = field(default=())
    maxnreg: int | None = None  # a register cap per thread (NVIDIA only: more programs resident per SM)

    def source(self):
        fn = self.kernel
        names = fn.arg_names
        missing = [n for n in names if n not in self.types and n not in self.constexprs]
        if missing:
            raise TypeError(f"{self.name}: no type for {missing}")
        signature = {n: "constexpr" if n in self.constexprs else self.types[n] for n in names}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if n not in self.constexprs and (signature[n].startswith("*") or n in self.aligned)
        }
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=self.constexprs, attrs=attrs)


def _int(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    return max((int(v) for v in found), default=0)


def _report_hip(asm: dict) -> dict:
    gcn = asm["amdgcn"]
    vgpr = _int(r"\.vgpr_count:\s+(\d+)", gcn)
    agpr = _int(r"\.agpr_count:\s+(\d+)", gcn)
    spills = _int(r"\.vgpr_spill_count:\s+(\d+)", gcn)
    scratch = _int(r"ScratchSize:\s+(\d+)", gcn)
    return {
        "registers": vgpr + agpr,
        "vgprs": vgpr,
        "agprs": agpr,
        "sgprs": _int(r"\.sgpr_count:\s+(\d+)", gcn),
        "spill_bytes": max(scratch, 4 * spills),
        "occupancy": _int(r"; Occupancy:\s+(\d+)", gcn),
        "matrix_instructions": len(re.findall(r"^\s*v_mfma", gcn, re.M)),
    }


def _ptxas(arch: Arch) -> str:
    """The ptxas Triton itself assembles with for this arch (it ships two; only one reads its PTX version)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch.target_arch).path
    except TypeError:  # older Triton: get_ptxas() takes no arch
        return compiler.get_ptxas().path


def _report_cuda(asm: dict, arch: Arch) -> dict:
    ptxas = _ptxas(arch)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = f"{tmp}/k.ptx"
        with open(ptx, "w") as f:
            f.write(asm["ptx"])
        # sm_90a: the target Triton itself assembles for on Hopper (wgmma needs the "a" variant)
        log = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch.target_arch}a", ptx, "-o", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    ptx_text = asm["ptx"]
    return {
        "registers": _int(r"Used (\d+) registers", log),
        "spill_bytes": _int(r"(\d+) bytes spill stores", log) + _int(r"(\d+) bytes spill loads", log),
        "stack_bytes": _int(r"(\d+) bytes stack frame", log),
        "matrix_instructions": len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\.", ptx_text)),
    }


def compile_variant(variant: AotVariant, arch: Arch) -> dict:
    """Compile one variant for `arch`; a dict with the report's keys (ok False and `error` on failure)."""
    row: dict[str, Any] = {"name": variant.name, "target": arch.name, "ok": False, "registers": None,
                           "spill_bytes": None, "shared_bytes": None, "matrix_instructions": None}
    try:
        compiled = triton.compile(
            variant.source(),
            target=arch.gpu_target(),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages}
            | ({"maxnreg": variant.maxnreg} if variant.maxnreg else {}),
        )
        row.update(_report_hip(compiled.asm) if arch.backend == "hip" else _report_cuda(compiled.asm, arch))
        row["shared_bytes"] = compiled.metadata.shared
        row["ok"] = True
    except Exception as e:  # a compile error is a row of the report, not a crash of the report
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return row


def collect(arch: Arch, modules: list[str] | None = None) -> list[AotVariant]:
    variants: list[AotVariant] = []
    for name in modules or KERNEL_MODULES:
        variants.extend(importlib.import_module(name).aot_variants(arch))
    return variants


def run(target: str, modules: list[str] | None = None) -> list[dict]:
    arch = ARCHS[target]
    return [compile_variant(v, arch) for v in collect(arch, modules)]


def failed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["ok"] or r["spill_bytes"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3sdk_kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(ARCHS))
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--module", action="append", help="only these kernel modules (repeatable)")
    args = parser.parse_args(argv)
    rows = run(args.target, args.module)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'variant':48} {'ok':3} {'regs':>5} {'spill':>6} {'smem':>7} {'mma':>4}  extra")
        for r in rows:
            extra = r.get("error") or (f"occupancy {r['occupancy']}" if "occupancy" in r else "")
            print(f"{r['name']:48} {'yes' if r['ok'] else 'NO':3} {r['registers'] or 0:>5} "
                  f"{r['spill_bytes'] or 0:>6} {r['shared_bytes'] or 0:>7} {r['matrix_instructions'] or 0:>4}"
                  f"  {extra}")
    for entry in TRITON_LIMITS:
        limit = triton_limit(entry, ARCHS[args.target])
        if limit is not None:
            print(f"NOTE {entry} on {args.target}: triton {triton.__version__}: {limit[0]}; built and run with "
                  f"{limit[1]} instead", file=sys.stderr)
    bad = failed(rows)
    for r in bad:
        why = r.get("error") or f"{r['spill_bytes']} bytes spilled"
        print(f"FAIL {r['name']} on {r['target']}: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

