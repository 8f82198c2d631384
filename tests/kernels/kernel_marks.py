"""Which platform a kernel test case needs, as pytest marks: on a GPU the kernels compile for that GPU, so a case
of another vendor's type skips there (on a CPU the interpreter runs every case).

    @amd_only                                 or   pytest.param("fp8nuz", marks=amd_only)
"""

import pytest
import torch

_GPU = torch.cuda.is_available()
_HIP = bool(torch.version.hip)

# float8_e4m3fnuz (Triton's fp8e4b8) is gfx942's fp8: NVIDIA GPUs have no such type
amd_only = pytest.mark.skipif(_GPU and not _HIP, reason="AMD-only case (e4m3fnuz / gfx9 variants) on an NVIDIA GPU")
# with @pytest.mark.gpu: tests of what only runs compiled (CUDA graphs, PDL, large shapes)
needs_gpu = pytest.mark.skipif(not _GPU, reason="needs a GPU")
# PDL, TMA, wgmma variants and inline PTX
nvidia_only = pytest.mark.skipif(_GPU and _HIP, reason="NVIDIA-only case on an AMD GPU")


def kv_dtypes(*names: str) -> list:
    """KV / index dtype names for parametrize, "fp8nuz" marked `amd_only`."""
    return [pytest.param(n, marks=amd_only) if n == "fp8nuz" else n for n in names]
