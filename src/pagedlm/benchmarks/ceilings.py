"""Measure the two ceilings the speed-of-light figures use: device memory bandwidth (a
large device-to-device copy, bytes read plus written) and the bf16 matmul rate (8192^3 on
random data). ``python -m pagedlm.benchmarks.ceilings`` on the GPU."""

from __future__ import annotations

import torch


def _median_ms(fn, warmup: int = 3, repeat: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure() -> tuple[float, float]:
    """(bytes/s, FLOP/s)."""
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms / 1e3)
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    return bandwidth, 2 * m**3 / (mm_ms / 1e3)


def main() -> None:
    bandwidth, flops = measure()
    print(
        f"ceilings: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )


if __name__ == "__main__":
    main()
