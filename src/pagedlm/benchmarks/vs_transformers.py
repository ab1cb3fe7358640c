"""Offline throughput of pagedlm against transformers, same machine, same run, same prompts.

    python -m pagedlm.benchmarks.vs_transformers --batch-sizes 1 32 --output-len 128

Both engines get the same weights (the embedded SmolLM2 by default, loaded once by pagedlm
and copied into a transformers ``LlamaForCausalLM``), the same token-id prompts, greedy
decoding with EOS ignored, and report output tokens per second of wall time (prefill
included). The ratio is pagedlm / transformers.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedlm import LLM, SamplingParams

PROMPT_TEXT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and what the message says."
)


def make_prompts(tokenizer, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted prompts with a random numeric suffix, so no two are identical."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch_size):
        text = f"{PROMPT_TEXT} Story number {rng.randrange(10**6)}."
        prompts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return prompts


def transformers_model(llm: LLM):
    """A transformers LlamaForCausalLM holding exactly pagedlm's weights."""
    import transformers

    config = llm.llm_engine.config
    arch = config.model.arch
    hf_config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).to(config.model.dtype).eval()
    from pagedlm.model_executor.loader import iter_model_weights

    state = dict(iter_model_weights(config.model))
    missing, _ = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model


def run_pagedlm(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def run_transformers(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    width = max(map(len, prompts))
    # Left padding, as transformers' batched generation requires.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == output_len
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    llm.generate("warm up", SamplingParams(max_tokens=1), use_tqdm=False)
    print(f"LLM() + first token: {time.perf_counter() - start:.2f} s")
    tokenizer = llm.get_tokenizer()
    hf = transformers_model(llm)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    print(f"torch threads: {torch.get_num_threads()}")
    print("batch  output_len  pagedlm tok/s  transformers tok/s  ratio")
    for batch_size in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch_size)
        ours = run_pagedlm(llm, prompts, args.output_len)
        theirs = run_transformers(hf, prompts, args.output_len, pad_id)
        print(
            f"{batch_size:5d}  {args.output_len:10d}  {ours:13.1f}  {theirs:18.1f}  "
            f"{ours / theirs:5.2f}x"
        )


if __name__ == "__main__":
    main()
