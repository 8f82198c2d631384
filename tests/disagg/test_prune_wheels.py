"""scripts/prune_ucx_wheels.py keeps what UCX opens at run time, among it the libraries auditwheel vendored."""

import importlib.util
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prune_ucx_wheels.py"


def _prune():
    spec = importlib.util.spec_from_file_location("prune_ucx_wheels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repack_keeps_vendored_libraries_and_drops_copies(tmp_path):
    kept = ["libucx/lib/libucp.so", "libucx/lib/libucp.so.0", "libucx/lib/ucx/libuct_cuda.so",
            "libucx/lib/ucx/libucm_cuda.so.0", "libucx/bin/ucx_info",
            # libucm_cuda.so needs this libcudart: without it UCX took CUDA buffers for host memory ()
            "libucx_cu13.libs/libcudart-96c42e41.so.13.0.96", "libucx_cu13.libs/libgomp-855c301a.so.1.0.0"]
    dropped = ["libucx/lib/libucp.so.0.0.0", "libucx/lib/libucp.a", "libucx/lib/libucp.la",
               "libucx/lib/ucx/libucx_perftest_cuda.so", "libucx/bin/ucx_perftest", "libucx/bin/io_demo"]
    record = "libucx_cu13-1.21.0.dist-info/RECORD"
    src, dest = tmp_path / "in.whl", tmp_path / "out.whl"
    with zipfile.ZipFile(src, "w") as z:
        for name in kept + dropped:
            z.writestr(name, name.encode())
        z.writestr(record, "stale\n")
    _prune().repack(src, dest)
    with zipfile.ZipFile(dest) as z:
        assert sorted(z.namelist()) == sorted([*kept, record])
        lines = z.read(record).decode().splitlines()
    assert sorted(line.split(",")[0] for line in lines) == sorted([*kept, record])
    assert all(line.split(",")[2] == str(len(line.split(",")[0])) for line in lines[:-1])  # sizes of the contents
