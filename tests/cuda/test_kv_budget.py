"""KV-cache sizing on the CUDA platform with made-up memory numbers (runs on CPU).

The start-up error for a ``max_model_len`` that does not fit must say how many tokens fit
and which flags to change, and the numbers it suggests must actually work.
"""

from __future__ import annotations

import re

import pytest

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm_cuda.platform import CudaPlatform, GpuMemory, check_kv_cache_fits, kv_cache_budget

GIB = 2**30
BLOCK = 16
PER_BLOCK = 2 * 28 * BLOCK * 8 * 128 * 2  # qwen3-0.6b in bf16: 112 KiB per token
MEMORY = GpuMemory(total=140 * GIB, in_use=2 * GIB, activation_peak=GIB)


def test_budget_is_the_fraction_minus_use_and_peak() -> None:
    assert kv_cache_budget(MEMORY, 0.5) == 70 * GIB - 3 * GIB
    assert kv_cache_budget(MEMORY, 0.01) == 0  # never negative


def test_fitting_length_passes() -> None:
    check_kv_cache_fits(MEMORY, 0.9, PER_BLOCK, BLOCK, max_model_len=40960)


def test_too_long_says_what_fits_and_the_flags_and_both_fixes_work() -> None:
    utilization, max_model_len = 0.03, 40960  # 4.2 GiB - 3 GiB: ~11k tokens
    with pytest.raises(ValueError) as error:
        check_kv_cache_fits(MEMORY, utilization, PER_BLOCK, BLOCK, max_model_len)
    message = str(error.value)
    fits = kv_cache_budget(MEMORY, utilization) // PER_BLOCK * BLOCK
    assert 0 < fits < max_model_len
    assert f"holds {fits} tokens" in message
    assert f"--max-model-len to at most {fits}" in message
    assert "--max-num-batched-tokens" in message
    suggested = float(re.search(r"--gpu-memory-utilization to at least ([0-9.]+)", message)[1])
    # Each suggestion is enough on its own, and the suggested fraction is the smallest
    # that is (in hundredths).
    check_kv_cache_fits(MEMORY, utilization, PER_BLOCK, BLOCK, fits)
    check_kv_cache_fits(MEMORY, suggested, PER_BLOCK, BLOCK, max_model_len)
    with pytest.raises(ValueError):
        check_kv_cache_fits(MEMORY, suggested - 0.01, PER_BLOCK, BLOCK, max_model_len)
    with pytest.raises(ValueError):
        check_kv_cache_fits(MEMORY, utilization, PER_BLOCK, BLOCK, fits + 1)


def test_nothing_fits_and_no_fraction_helps() -> None:
    crowded = GpuMemory(total=16 * GIB, in_use=15 * GIB, activation_peak=GIB // 2)
    with pytest.raises(ValueError) as error:
        check_kv_cache_fits(crowded, 0.9, PER_BLOCK, BLOCK, max_model_len=40960)
    message = str(error.value)
    assert "holds 0 tokens" in message
    assert "no --max-model-len is short enough" in message
    assert "--gpu-memory-utilization cannot help" in message


def test_platform_checks_the_bound_config(tiny_checkpoint, monkeypatch) -> None:
    """The platform's sizing path uses the bound fraction, block size and length."""
    config, _ = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        platform="cpu",
    ).create_engine_config()
    platform = CudaPlatform()
    platform.bind_config(config)
    # tiny llama in float32: 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes = 512 B/token
    roomy = GpuMemory(total=4 * 2**20, in_use=2**20, activation_peak=0)  # 1 MiB budget
    monkeypatch.setattr(platform, "measure_memory", lambda: roomy)
    assert platform.kv_cache_memory_bytes() == 2**20
    tight = GpuMemory(total=4 * 2**20, in_use=2**20 + 2**20 - 2**18, activation_peak=0)
    monkeypatch.setattr(platform, "measure_memory", lambda: tight)
    with pytest.raises(ValueError, match=r"holds 512 tokens.*--max-model-len to at most 512"):
        platform.kv_cache_memory_bytes()


def test_retired_env_var_is_reported_not_read(monkeypatch, caplog) -> None:
    monkeypatch.setenv("PAGEDLM_GPU_MEMORY_UTILIZATION", "0.5")
    platform = CudaPlatform()  # unbound: the default fraction, not the variable's
    monkeypatch.setattr(platform, "measure_memory", lambda: MEMORY)
    with caplog.at_level("WARNING", logger="pagedlm_cuda.platform"):
        assert platform.kv_cache_memory_bytes() == kv_cache_budget(MEMORY, 0.9)
    assert "--gpu-memory-utilization" in caplog.text
