"""Shared fixtures. The oracle checkpoints (see tests/oracle.py) are built once per session."""

import os
import shutil

import torch

# Triton decides compiled vs interpreted when @triton.jit runs, i.e. when m3sdk_kernels is first imported: on a
# machine without a GPU every test runs the kernels in the interpreter, so set it before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import structlog  # noqa: E402
from oracle import load_oracle, make_oracle_checkpoint, write_byte_tokenizer

# The machine's markers (registered in pyproject.toml): a test marked with one the machine lacks is skipped.
# `multi_gpu(n)` needs n devices (default 2); `nvidia` / `amd` need a GPU of that vendor (fp8e4nv vs fp8e4b8 cases);
# `cpu_only` needs a machine without one (what a user without a GPU sees).
_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_VENDOR = None if not _GPUS else ("amd" if torch.version.hip else "nvidia")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _missing_hardware(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _missing_hardware(item: pytest.Item) -> str | None:
    if item.get_closest_marker("gpu") and not _GPUS:
        return "needs a GPU"
    multi = item.get_closest_marker("multi_gpu")
    if multi:
        needed = multi.args[0] if multi.args else 2
        if _GPUS < needed:
            return f"needs {needed} GPUs, this machine has {_GPUS}"
    if item.get_closest_marker("cpu_only") and _GPUS:
        return "needs a machine without a GPU"
    for vendor in ("nvidia", "amd"):
        if item.get_closest_marker(vendor) and _VENDOR != vendor:
            return f"needs an {vendor.upper()} GPU"
    return None


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where tests put their tensors and engines: the GPU when one is present (kernels run compiled), else the CPU
    (kernels run in the Triton interpreter, switched on above). The one place that decides."""
    return torch.device("cuda" if _GPUS else "cpu")


@pytest.fixture
def ieee_fp32(monkeypatch):
    """fp32 tl.dot is TF32 on a GPU by default (bf16-like rounding): full fp32 for comparisons against fp32 math."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture
def few_prefill_splits(monkeypatch, device):
    """Under the interpreter every program runs in Python: prefill splits that fill a GPU's SMs only multiply the
    time (the kernel tests cover splits and the merge; decode steps still split). On a GPU the tables stay."""
    if device.type == "cpu":
        from m3sdk_kernels import arch

        for family in ("attn_prefill", "sparse_prefill"):
            monkeypatch.setitem(arch.TILES[family], "sm90", arch.TILES[family]["sm90"] | {"SPLIT_PROGRAMS": 1})


@pytest.fixture(autouse=True)
def unconfigured_structlog():
    """Every test starts with structlog as an application that never configured it: structlog's capture_logs
    leaves it configured, and a configured structlog is where the engine's logs go (to stdout), which would break
    the next test that checks the engine is silent."""
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def seeded_torch():
    """Random inputs the same in every run whatever ran before (engine tests in threads and processes consume
    the global generator a timing-dependent number of times)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The CPU forwards here are many small ops: one intra-op thread. On a shared, oversubscribed CPU, OpenMP
    threads waiting for each other at every op made a 60-step generation take 45 s instead of 0.3 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def oracle_checkpoint(tmp_path_factory):
    """A tiny random MiniMax-M3 checkpoint as transformers saves it (one model.safetensors)."""
    return make_oracle_checkpoint(tmp_path_factory.mktemp("oracle_hf"), layout="hf")


@pytest.fixture(scope="session")
def oracle_checkpoint_minimax(tmp_path_factory):
    """The same weights under the published MiniMax names, sharded with an index file."""
    return make_oracle_checkpoint(tmp_path_factory.mktemp("oracle_minimax"), layout="minimax")


@pytest.fixture(scope="session")
def oracle_hf(oracle_checkpoint):
    """transformers' MiniMaxM3VLForCausalLM of `oracle_checkpoint` (float32, eager attention)."""
    return load_oracle(oracle_checkpoint)


@pytest.fixture(scope="session")
def engine_checkpoint(oracle_checkpoint, tmp_path_factory):
    """`oracle_checkpoint` made engine-ready: the byte-level tokenizer and chat template beside the weights
    (MSA drops blocks past position 24 in this model)."""
    directory = tmp_path_factory.mktemp("engine_ckpt")
    shutil.copytree(oracle_checkpoint, directory, dirs_exist_ok=True)
    write_byte_tokenizer(directory)
    return directory
