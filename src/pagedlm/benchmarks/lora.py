"""``python -m pagedlm.benchmarks.lora``: multi-LoRA decode speed against the base model,
the LoRA kernels' time per projection, and the latency of an adapter loaded at run time.

Random PEFT adapters of the model's shape (rank ``--rank`` on q/k/v/o/gate/up/down, bf16)
are written to a temporary directory. Three measurements, each in one engine (bf16, CUDA
graphs on):

1. decode throughput: ``--batch-size`` requests with ``--num-adapters`` adapters round
   robin, against the same requests on the base model; then batch 1 with one adapter
   against batch 1 without (targets: >= 85% and >= 90% of the base tok/s);
2. kernel time per projection: shrink + expand for the projection shapes at the decode
   batch (``--num-adapters`` adapters) and at batch 1, next to the base GEMM;
3. run-time load: while ``--batch-size`` requests decode, a never-seen adapter is checked
   and its first request queued; the time until its first token (target: < 1 s).

The H200 command (Llama-3-8B shape)::

    python -m pagedlm.benchmarks.lora --model llama-3-8b --rank 16 --num-adapters 8 \\
        --batch-size 64 --input-len 128 --output-len 256
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

from pagedlm.benchmarks.cli import parse_bench_args
from pagedlm.benchmarks.common import add_engine_args, build_llm

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("LoRA benchmark arguments")
    group.add_argument("--rank", type=int, default=16)
    group.add_argument("--num-adapters", type=int, default=8)
    group.add_argument("--batch-size", type=int, default=64)
    group.add_argument("--input-len", type=int, default=128)
    group.add_argument("--output-len", type=int, default=256)
    group.add_argument("--num-iters", type=int, default=3)
    group.add_argument("--kernel-iters", type=int, default=200)


def write_random_adapter(path: Path, arch, rank: int, seed: int) -> None:
    """A PEFT adapter directory for ``arch`` (every layer, every projection), bf16."""
    import torch
    from safetensors.torch import save_file

    from pagedlm.lora.targets import module_shapes

    shapes = module_shapes(arch)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for name in PROJECTIONS:
            in_features, out_features = shapes[name]
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            a = torch.randn(rank, in_features, generator=generator) * in_features**-0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def _tok_per_s(llm, prompts, loras, output_len: int, num_iters: int) -> float:
    from pagedlm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    best = 0.0
    for i in range(num_iters + 1):  # the first run warms up
        # A new first token per run: prefix caching would otherwise skip the prefills.
        batch = [{"prompt_token_ids": [i] + p[1:]} for p in prompts]
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        if i:
            best = max(best, len(prompts) * output_len / elapsed)
    return best


def decode_speed(llm, args, loras) -> dict[str, float]:
    import random

    rng = random.Random(0)
    vocab = min(10000, llm.llm_engine.config.model.arch.vocab_size)
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)
    ]
    mixed = [loras[i % len(loras)] for i in range(args.batch_size)]
    n, out = args.num_iters, args.output_len
    result = {
        "batch_base": _tok_per_s(llm, prompts, None, out, n),
        "batch_lora": _tok_per_s(llm, prompts, mixed, out, n),
        "single_base": _tok_per_s(llm, prompts[:1], None, out, n),
        "single_lora": _tok_per_s(llm, prompts[:1], loras[0], out, n),
    }
    b = args.batch_size
    print(
        f"decode batch {b}, {len(loras)} adapters: {result['batch_lora']:.0f} tok/s vs "
        f"{result['batch_base']:.0f} without LoRA = "
        f"{100 * result['batch_lora'] / result['batch_base']:.1f}% (target >= 85%)\n"
        f"decode batch 1, one adapter: {result['single_lora']:.1f} tok/s vs "
        f"{result['single_base']:.1f} = "
        f"{100 * result['single_lora'] / result['single_base']:.1f}% (target >= 90%)",
        flush=True,
    )
    return result


def kernel_times(arch, rank: int, num_adapters: int, batch_sizes: list[int], iters: int) -> None:
    """Shrink + expand per projection (microseconds, in a CUDA graph), next to the base GEMM."""
    import torch
    import torch.nn.functional as F

    from pagedlm.lora.ops import LoRAStepState, SliceSpec
    from pagedlm_cuda.kernels.lora import TritonLoRAOps

    shapes = arch_projection_slices(arch)
    ops = TritonLoRAOps()
    for batch in batch_sizes:
        for name, (in_features, sizes) in shapes.items():
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            slices = tuple(SliceSpec(s, n) for s, n in zip(starts, sizes, strict=True))
            kw = dict(device="cuda", dtype=torch.bfloat16)
            lora_a = torch.randn(num_adapters, len(sizes) * rank, in_features, **kw)
            lora_b = torch.randn(num_adapters, sum(sizes), rank, **kw)
            weight = torch.randn(sum(sizes), in_features, **kw)
            x = torch.randn(batch, in_features, **kw)
            slots = torch.arange(batch, dtype=torch.int32, device="cuda") % min(num_adapters, batch)
            state = LoRAStepState(slots)
            out = F.linear(x, weight)
            active = [True] * num_adapters

            lora = functools.partial(ops.add_lora, out, x, lora_a, lora_b, slices, state, active)
            base = functools.partial(F.linear, x, weight)
            lora_us, base_us = _time_us(lora, iters), _time_us(base, iters)
            print(
                f"kernels batch {batch:3d} {name:8s} [{in_features} -> {sum(sizes)}]: "
                f"LoRA shrink+expand {lora_us:7.1f} us, base GEMM {base_us:7.1f} us",
                flush=True,
            )


def arch_projection_slices(arch) -> dict[str, tuple[int, list[int]]]:
    """pagedlm's fused projections: name -> (in_features, output slice sizes)."""
    from pagedlm.lora.targets import module_shapes

    shapes = module_shapes(arch)
    hidden, q = shapes["q_proj"]
    kv = shapes["k_proj"][1]
    inter = shapes["gate_proj"][1]
    return {
        "qkv_proj": (hidden, [q, kv, kv]),
        "o_proj": (shapes["o_proj"][0], [hidden]),
        "gate_up": (hidden, [inter, inter]),
        "down": (inter, [hidden]),
    }


def _time_us(fn, iters: int) -> float:
    """Microseconds per call, replayed from a CUDA graph (as decode steps run: the
    Python launch cost of each kernel is not part of it)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def runtime_load_latency(llm, args, new_adapter) -> float:
    """Seconds from checking a never-seen adapter to its request's first token, while
    ``--batch-size`` other requests decode."""
    from pagedlm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    for i in range(args.batch_size):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": [7 + i] * args.input_len}, params)
    for _ in range(8):
        engine.step()
    start = time.perf_counter()
    engine.add_lora(new_adapter)
    engine.add_request(
        "new-adapter",
        {"prompt_token_ids": [3] * args.input_len},
        SamplingParams(temperature=0.0, max_tokens=1),
        lora_request=new_adapter,
    )
    latency = None
    while latency is None:
        for out in engine.step():
            if out.request_id == "new-adapter" and out.finished:
                latency = time.perf_counter() - start
    engine.abort_request([f"stream-{i}" for i in range(args.batch_size)])
    while engine.has_unfinished_requests():
        engine.step()
    print(
        f"run-time load of a rank-{args.rank} adapter while {args.batch_size} requests "
        f"decode: first token after {latency * 1e3:.0f} ms (target < 1000 ms)",
        flush=True,
    )
    return latency


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedlm import LoRARequest

    # One slot more than the adapters of the mixed batch: the run-time one needs its own.
    args.enable_lora = True
    args.max_loras = args.num_adapters + 1
    args.max_lora_rank = max(args.max_lora_rank, args.rank)
    args.max_cpu_loras = args.max_loras
    llm, _ = build_llm(args)
    arch = llm.llm_engine.config.model.arch
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for index in range(args.num_adapters + 1):
            path = Path(root) / f"adapter{index}"
            write_random_adapter(path, arch, args.rank, seed=index)
            loras.append(LoRARequest(f"adapter{index}", index + 1, str(path)))
        decode_speed(llm, args, loras[:-1])
        if torch.cuda.is_available():
            batches = [args.batch_size, 1]
            kernel_times(arch, args.rank, args.num_adapters, batches, args.kernel_iters)
        else:
            print("kernel times: skipped (no CUDA device)", flush=True)
        runtime_load_latency(llm, args, loras[-1])


def main(argv: list[str] | None = None) -> None:
    run(parse_bench_args(__doc__, add_args, argv))


if __name__ == "__main__":
    main()
