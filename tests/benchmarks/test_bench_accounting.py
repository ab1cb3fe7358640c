"""Benchmark inputs and speed-of-light accounting (no model is run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model
from pagedlm.benchmarks.speed_of_light import speed_of_light, weight_params
from pagedlm.benchmarks.throughput import nanovllm_dataset, random_dataset
from pagedlm.config import ArchConfig


def test_nanovllm_dataset_is_nano_vllms() -> None:
    prompts, output_lens = nanovllm_dataset()
    assert len(prompts) == 256 and len(output_lens) == 256
    assert sum(output_lens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_random_dataset_lengths_respect_range_ratio() -> None:
    prompts, outs = random_dataset(50, 100, 20, 0.5)
    assert all(50 <= len(p) <= 150 for p in prompts)
    assert all(10 <= o <= 30 for o in outs)
    fixed, fixed_outs = random_dataset(3, 7, 5, 0.0)
    assert [len(p) for p in fixed] == [7] * 3 and fixed_outs == [5] * 3


@pytest.mark.parametrize("name", sorted(BUILTIN_SHAPES))
def test_builtin_shapes_parse_and_resolve(name: str) -> None:
    directory = Path(resolve_model(name))
    arch = ArchConfig.from_directory(directory)
    assert arch.architecture == BUILTIN_SHAPES[name]["architectures"][0]
    assert json.loads((directory / "config.json").read_text()) == BUILTIN_SHAPES[name]


def test_unknown_model_names_the_builtin_shapes() -> None:
    with pytest.raises(ValueError, match=r"qwen3-0\.6b"):
        resolve_model("no-such-model")


def test_speed_of_light_matches_the_issue_targets() -> None:
    qwen = ArchConfig.from_hf_dict(BUILTIN_SHAPES["qwen3-0.6b"])
    step_params, _ = weight_params(qwen)
    assert 590e6 < step_params < 600e6  # Qwen3-0.6B without its input embedding
    prompts, outs = nanovllm_dataset()
    sol = speed_of_light(qwen, [len(p) for p in prompts], outs)
    assert sum(outs) / sol.seconds == pytest.approx(35_800, rel=0.01)

    llama = ArchConfig.from_hf_dict(BUILTIN_SHAPES["llama-3-8b"])
    sol = speed_of_light(llama, [1024], [256])
    assert sol.weight_bytes == 256 * 2 * weight_params(llama)[0]
    # Weights dominate: ~15 GB a step at 4.3 TB/s, about 280 tok/s.
    assert 270 < 256 / sol.seconds < 290


def test_profile_timeline_charges_overlapping_kernels_from_the_previous_end() -> None:
    """A kernel that starts early (programmatic dependent launch) is charged from the
    previous kernel's end; gaps are idle, listed by the kernel that ended them; the
    charges plus the idle are the span."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from pagedlm.benchmarks.common import _timeline_lines

    def kernel(name: str, start: float, end: float):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=span)

    cpu_op = SimpleNamespace(
        name="op", device_type=DeviceType.CPU, time_range=SimpleNamespace(start=0, end=99)
    )
    events = [kernel("a", 0, 10), kernel("b", 5, 30), kernel("c", 40, 45), kernel("a", 44, 50)]
    prof = SimpleNamespace(events=lambda: [*events, cpu_op])
    lines = _timeline_lines(prof, model_steps=1)
    assert lines[0].startswith("timeline over 0.050 ms/step") and "idle 0.010" in lines[0]
    gaps = lines.index("idle before (the kernel that ended the gap):")
    charged = {line.split()[-1]: float(line.split()[0]) for line in lines[1:gaps]}
    assert charged == {"a": 15.0, "b": 20.0, "c": 5.0}
    assert [line.split() for line in lines[gaps + 1 :]] == [["10.0", "us/step", "c"]]


def test_jit_compiles_collects_inside_and_restores_the_previous_hook() -> None:
    from types import SimpleNamespace

    from triton import knobs  # the test extra pins triton

    from pagedlm.benchmarks.common import jit_compiles, jit_compiles_line

    kernels = ["_decode_kernel", "_pick_kernel", "_decode_kernel"]
    earlier: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **kw: earlier.append(fn.name)
    try:
        with jit_compiles() as names:
            # What Triton calls after compiling a kernel (``JITFunction._call_hook``).
            for name in kernels:
                hook = knobs.runtime.jit_post_compile_hook
                hook(fn=SimpleNamespace(name=name), key=None, repr=f"{name}(m: i32)")
        assert [name for name, _ in names] == kernels
        assert earlier == kernels  # chained to the hook that was there
        assert jit_compiles_line(names).split("\n") == [
            "3 Triton kernels compiled inside the timing: _decode_kernel x2, _pick_kernel x1",
            *(f"  {name}(m: i32)" for name in kernels),
        ]
        knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="after"), key=None)
        assert len(names) == 3  # restored: nothing collected after the block
        assert earlier[-1] == "after"
        assert jit_compiles_line([]) is None
    finally:
        knobs.runtime.jit_post_compile_hook = None
