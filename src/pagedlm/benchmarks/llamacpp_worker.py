"""llama.cpp side of ``vs_llamacpp``: greedy decoding of a batch of prompts, timed.

Runs as a script in the interpreter that has llama-cpp-python (the benchmark's own venv;
it is never a pagedlm dependency), so it imports nothing from pagedlm:

    <venv>/bin/python llamacpp_worker.py --model M.gguf --threads 1 --max-seqs 32 --n-ctx 256

Then one JSON request per stdin line, ``{"prompts": [[token ids], ...], "output_len": N}``,
one JSON answer per stdout line, ``{"seconds": s, "output_tokens": n, "first_ids": [...]}``.
All prompts are prefilled together (one sequence id each, in chunks of the context's batch
size), then every step decodes one token per sequence in one ``llama_decode`` call; the
next token is the argmax of the logits, EOS included (it never stops early). The KV cache
is cleared before each request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import numpy as np


class Batch:
    """A ``llama_batch`` that ``decode`` fills with (token, position, sequence, logits?)."""

    def __init__(self, ctx, capacity: int, max_seqs: int) -> None:
        self.ctx = ctx
        self.capacity = capacity
        self.batch = llama_cpp.llama_batch_init(capacity, 0, max_seqs)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        status = llama_cpp.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")


def greedy(ctx, batch: Batch, n_vocab: int, prompts: list[list[int]], output_len: int):
    """Every sequence's ``output_len`` greedy tokens (the first comes from the prefill)."""

    def argmax(index: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, index)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    entries = [
        (token, position, seq, position == len(prompt) - 1)
        for seq, prompt in enumerate(prompts)
        for position, token in enumerate(prompt)
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(entries), batch.capacity):
        chunk = entries[start : start + batch.capacity]
        batch.decode(chunk)
        for index, (_, _, seq, wants_logits) in enumerate(chunk):
            if wants_logits:
                outputs[seq].append(argmax(index))
    for _ in range(output_len - 1):
        batch.decode(
            [(out[-1], len(prompt) + len(out) - 1, seq, True)
             for seq, (prompt, out) in enumerate(zip(prompts, outputs))]
        )  # fmt: skip
        for seq, out in enumerate(outputs):
            out.append(argmax(seq))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-seqs", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument(
        "--no-repack", action="store_true", help="no extra weight buffers (AMX, repacked)"
    )
    args = parser.parse_args()

    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = not args.no_repack
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), model_params)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = args.n_ctx * args.max_seqs
    params.n_batch = args.n_batch
    params.n_seq_max = args.max_seqs
    params.n_threads = params.n_threads_batch = args.threads
    params.kv_unified = False  # independent sequences: each attends over its own cells
    ctx = llama_cpp.llama_init_from_model(model, params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = Batch(ctx, args.n_batch, args.max_seqs)
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        start = time.perf_counter()
        outputs = greedy(ctx, batch, n_vocab, request["prompts"], request["output_len"])
        seconds = time.perf_counter() - start
        answer = {
            "seconds": seconds,
            "output_tokens": sum(map(len, outputs)),
            "first_ids": outputs[0][:16],
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
