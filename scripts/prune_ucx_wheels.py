"""Copy the ucxx stack's wheels into a folder small enough to travel with a device run (64 MiB a call carries).

    python scripts/prune_ucx_wheels.py SRC_DIR [DEST_DIR=.whlucx]

SRC_DIR holds the wheels of ucxx, libucxx, libucx, rmm, librmm (all -cu12 or all -cu13) and rapids-logger (which
librmm loads; fetch-wheels.sh leaves it out). The H200 image is CUDA 13 (torch +cu130, cuda-bindings 13), and
rmm-cu12 wants cuda-bindings < 13, so the device takes the -cu13 stack:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d SRC_DIR ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 \
        rmm-cu13==26.10.0 librmm-cu13==26.10.0 'rapids-logger==0.3.*'

Every wheel but libucx's is copied as is. libucx's (42 MB) is repacked without what nothing at run time opens:
the static `.a` archives, libtool `.la` files, the perftest CUDA plugin, the perftest / io_demo binaries and the
`.so.0.0.0` copies in libucx/lib/ (a wheel cannot hold symlinks, so each library is there three times).
Kept: `libX.so`, which `libucx/load.py` opens by path (libucs, libucs_signal, libuct, libucp); `libX.so.0`, the
sonames other libraries name as NEEDED (libucm.so.0 is opened by that name; the others are kept in case a
library is loaded before load.py ran); the UCX modules under lib/ucx/ (libuct_cuda, libucm_cuda, libuct_cma: UCX
opens `lib<name>.so` beside the libucs it was loaded from); `ucx_info`; and libucx_cu1N.libs/, what auditwheel
vendored (libucm_cuda.so needs its libcudart). RECORD is rewritten for the files kept.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import sys
import zipfile
from pathlib import Path

# Only libucx/lib/ holds the triplicated UCX libraries. The libraries auditwheel vendored into libucx_cu1N.libs/
# also end in .so.X.Y.Z (libcudart-<hash>.so.13.0.96) and must stay: libucm_cuda.so needs that libcudart; without
# it UCX loads no CUDA memory hooks, its memory type cache calls every CUDA buffer host memory, and a CUDA tag
# message is copied by the CPU: SIGSEGV on the sender, a receiver waiting forever (the window-1 hang).
DROP = re.compile(r"^libucx/(lib/.*\.(a|la|so\.\d+\.\d+\.\d+)$|lib/ucx/libucx_perftest_cuda"
                  r"|bin/(ucx_perftest|io_demo|ucx_read_profile))")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(src: Path, dest: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            if info.filename == record_name or DROP.search(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(_record_line(info.filename, data))
        zout.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")


def main() -> None:
    src = Path(sys.argv[1])
    dest = Path(sys.argv[2] if len(sys.argv) > 2 else ".whlucx")
    dest.mkdir(exist_ok=True)
    for wheel in sorted(src.glob("*.whl")):
        name = re.sub(r"_cu1[23]$", "", wheel.name.split("-")[0])
        if name not in ("ucxx", "libucxx", "libucx", "rmm", "librmm", "rapids_logger"):
            continue
        if name == "libucx":
            repack(wheel, dest / wheel.name)
        else:
            shutil.copy2(wheel, dest / wheel.name)
        print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} -> {(dest / wheel.name).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
