"""CPU defaults: dtype by native bf16 support, one thread per core given, one OpenMP pool."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from pagedlm_cpu import platform as cpu_platform
from pagedlm_cpu import threads


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bf16_only_with_native_bf16(monkeypatch, caplog, native, expected):
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="pagedlm_cpu.platform"):
        # Whatever the checkpoint says: float16 and bf16 checkpoints alike.
        for config_dtype in (None, torch.float16, torch.bfloat16):
            assert cpu_platform.CpuPlatform().default_dtype(config_dtype) == expected
    assert f"CPU dtype: {str(expected).removeprefix('torch.')}" in caplog.text
    assert "overrides it" in caplog.text


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_native_bf16_probe_can_be_overridden(monkeypatch, value):
    monkeypatch.setenv(cpu_platform.NATIVE_BF16_ENV, value)
    assert cpu_platform.has_native_bf16() is (value == "1")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_pool_is_sized_to_the_cores_given(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores_given", lambda: 1)
    torch.set_num_threads(2)
    report = threads.configure_threads()
    assert torch.get_num_threads() == 1
    assert report.torch_threads == 1 and report.cores_given == 1 and not report.set_by_user
    assert "1 torch threads (the cores given" in report.describe()


def test_omp_num_threads_is_the_users_choice(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "cores_given", lambda: 1)
    torch.set_num_threads(2)
    report = threads.configure_threads()
    assert torch.get_num_threads() == 2 and report.set_by_user


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_is_loaded_and_a_second_is_reported(
    monkeypatch, caplog, restore_threads
):
    torch.ones(64).sum()  # the pool exists once torch has run a parallel op
    assert len(threads.loaded_openmp_runtimes()) == 1
    monkeypatch.setattr(threads, "loaded_openmp_runtimes", lambda: ("gomp", "iomp5"))
    with caplog.at_level(logging.WARNING, logger="pagedlm_cpu.threads"):
        threads.configure_threads()
    assert "Several OpenMP runtimes are loaded (gomp, iomp5)" in caplog.text


def test_a_cpu_step_takes_2048_tokens_unless_told_otherwise(tiny_checkpoint):
    """The CPU platform's token budget (smaller steps keep activations near the caches);
    the user's value and a larger max_num_seqs still win."""
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.platforms.interface import Platform

    path = str(tiny_checkpoint("llama"))
    assert Platform.default_max_num_batched_tokens == 8192
    assert cpu_platform.CpuPlatform.default_max_num_batched_tokens == 2048

    def budget(**kwargs) -> int:
        args = EngineArgs(model=path, skip_tokenizer_init=True, platform="cpu", **kwargs)
        return args.create_engine_config()[0].scheduler.max_num_batched_tokens

    assert budget() == 2048
    assert budget(max_num_batched_tokens=8192) == 8192
    assert budget(max_num_seqs=4096) == 4096


def _mapping_flags(start: int, end: int) -> list[list[str]]:
    """The ``VmFlags`` of every mapping of this process that overlaps [start, end)."""
    found, overlaps = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                overlaps = low < end and start < high
            elif overlaps and head == "VmFlags:":
                found.append(line.split()[1:])
    assert found, "no mapping holds the range"
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_kv_cache_is_zeros_paged_in_lazily_without_asking_for_huge_pages():
    size = 64 << 20
    cache = cpu_platform.CpuPlatform().zeros((size // 2 // 192, 3, 64), torch.bfloat16)
    assert cache.shape == (size // 2 // 192, 3, 64) and cache.dtype == torch.bfloat16
    # numpy's calloc madvises large arrays for THP ("hg"): first writes then stalled a
    # step for 4-5 ms each where THP is "madvise" (docs/performance.md, session 36).
    start = cache.data_ptr()
    flags = _mapping_flags(start, start + size)
    assert all("hg" not in f for f in flags)
    assert all("sh" not in f for f in flags)  # private memory, as malloc's: not shmem
    rows = cache.view(-1, 192)
    assert not rows[::2048].any()  # zeros, read a page in every 2,048 rows
    rows[-1] = 1.0
    del cache
    assert rows[-1].eq(1.0).all() and not rows[0].any()  # a view keeps the mapping alive
