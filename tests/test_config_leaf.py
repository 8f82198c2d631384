"""EngineConfig is a leaf: importing it (and building one) loads neither torch nor the kernels; "auto" settings are
resolved once, when the engine is built."""

import subprocess
import sys

import pytest

from m3sdk import EngineConfig


def test_importing_the_config_loads_no_torch():
    code = ("import sys; from m3sdk import EngineConfig, SamplingParams; "
            "EngineConfig(kv_cache_dtype='fp8', speculative='ngram', prefill_nodes=['a:1']); "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'm3sdk_kernels')]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_settings_resolve_against_the_device():
    from m3sdk.core.resolved import resolve

    rc = resolve(EngineConfig(device="cpu"))
    assert (str(rc.device), str(rc.dtype), rc.attention_backend, rc.cuda_graphs, rc.overlap) == (
        "cpu", "torch.float32", "torch", False, False)
    assert (rc.kv_cache_dtype, rc.index_cache_dtype, rc.kv_cache_layout) == ("fp32", "fp32", "plain")
    rc = resolve(EngineConfig(device="cpu", dtype="bfloat16", index_cache_dtype="fp8", overlap_scheduling=True))
    assert (rc.kv_cache_dtype, rc.index_cache_dtype, rc.overlap) == ("bf16", "fp8", True)
    assert not resolve(EngineConfig(device="cpu", overlap_scheduling=True, speculative="ngram")).overlap


def test_bad_values_are_refused_on_creation():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="medusa")


def test_knobs_are_grouped_and_read_flat():
    from m3sdk.config import CacheConfig, SchedulingConfig

    c = EngineConfig(kv_cache_dtype="fp8", max_num_seqs=4, max_num_batched_tokens=64, prefill_nodes=["n:1"],
                     tensor_parallel_size=2)
    assert c.cache.kv_cache_dtype == c.kv_cache_dtype == "fp8"
    assert (c.scheduling.max_num_seqs, c.disagg.prefill_nodes, c.parallel.tensor_parallel_size) == (4, ("n:1",), 2)
    again = c.replace(max_num_seqs=8)
    assert (again.max_num_seqs, again.kv_cache_dtype, c.max_num_seqs) == (8, "fp8", 4)
    whole = EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 20), scheduling=SchedulingConfig(max_num_seqs=2))
    assert whole.kv_cache_memory == 1 << 20 and whole.max_num_seqs == 2
    assert EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 20), kv_cache_dtype="bf16").cache == CacheConfig(
        kv_cache_memory=1 << 20, kv_cache_dtype="bf16")
    with pytest.raises(TypeError, match="no_such_knob"):
        EngineConfig(no_such_knob=1)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1.*quantization must be one of"):
        EngineConfig(max_num_seqs=0, quantization="int3")
