"""Triton kernels for MiniMax-M3 serving, each op beside its plain-torch reference (`*_ref`).

This package never imports `m3sdk`: the engine depends on it, not the other way round.
"""

from m3sdk_kernels.arch import ARCHS, Arch, current_arch, fp8_dtype, tiles

__all__ = ["ARCHS", "Arch", "current_arch", "fp8_dtype", "tiles"]
