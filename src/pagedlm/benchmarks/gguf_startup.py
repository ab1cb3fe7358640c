"""How long a GGUF model takes to load with its blocks for kernels, two ways.

    python -m pagedlm.benchmarks.gguf_startup [--layers 4] [--rounds 2] [--threads 2]

Writes a random Q4_0 file of Llama-3-8B's shape cut to ``--layers`` layers
(``quantized_gpu.write_random_q4_0_gguf``), then times on the CPU device, alternating:

- *dense, then blocks*: ``load_model`` dequantizing every tensor, then
  ``gguf_linear_blocks`` reading and decoding the file again and checking each layer's
  blocks against its loaded weight (how the CUDA platform loaded GGUF models before
  session 17);
- *keeping the blocks*: ``load_model(keep_weight_blocks=True)``, each tensor read once and
  the float weights of the layers with blocks never computed, nor allocated (the CPU and
  CUDA platforms' way now).

Also printed: the bytes the model's parameters hold after loading (on a GPU, what the
device must fit before kernels replace the dense weights).

Both ask for Q6_K's groups of 16 as the CUDA platform does (this file has none).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    import torch

    from pagedlm.benchmarks.quantized_gpu import SHAPE, write_random_q4_0_gguf
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.model_executor.loader import load_model
    from pagedlm.model_executor.loader.gguf_quantized import gguf_linear_blocks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "random-q4_0.gguf"
        size = write_random_q4_0_gguf(path, dict(SHAPE, num_hidden_layers=args.layers))
        config, _ = EngineArgs(
            model=str(path), dtype="bfloat16", platform="cpu", skip_tokenizer_init=True
        ).create_engine_config()
        cpu = torch.device("cpu")
        print(f"{size / 1e9:.2f} GB Q4_0 file, {args.layers} layers of llama-3-8b's shape")

        def timed(keep: bool) -> tuple[float, int, float]:
            start = time.perf_counter()
            model = load_model(config.model, cpu, keep_weight_blocks=keep, gguf_groups_of_16=True)
            gigabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
            layers = len(gguf_linear_blocks(model, str(path), groups_of_16=True))
            elapsed = time.perf_counter() - start
            del model
            gc.collect()
            return elapsed, layers, gigabytes

        for round_index in range(args.rounds):
            dense, dense_layers, dense_gb = timed(keep=False)
            kept, kept_layers, kept_gb = timed(keep=True)
            print(
                f"round {round_index + 1}: dense, then blocks {dense:.1f} s ({dense_layers} "
                f"layers, parameters {dense_gb:.2f} GB); keeping the blocks {kept:.1f} s "
                f"({kept_layers} layers, parameters {kept_gb:.2f} GB): {dense / kept:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
