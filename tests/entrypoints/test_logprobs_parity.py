"""Sampled and prompt logprobs equal transformers' log-softmax (fp32)."""

from __future__ import annotations

import random

import torch
import transformers

from pagedlm import LLM, SamplingParams


def test_logprobs_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (5, 40, 90)]
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_batched_tokens=32)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        full = prompt + completion.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)

        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            row = ref[pos - 1]
            actual = prompt[pos]
            assert abs(entry[actual].logprob - row[actual].item()) <= 1e-4
            assert entry[actual].rank == int((row > row[actual]).sum()) + 1
            top = torch.topk(row, 3).indices.tolist()
            for rank, token in enumerate(top, start=1):
                assert abs(entry[token].logprob - row[token].item()) <= 1e-4
                assert entry[token].rank == rank

        assert len(completion.logprobs) == len(completion.token_ids)
        for i, token in enumerate(completion.token_ids):
            row = ref[len(prompt) + i - 1]
            entry = completion.logprobs[i]
            assert token == int(row.argmax())
            assert abs(entry[token].logprob - row[token].item()) <= 1e-4
            assert entry[token].rank == 1
            assert len(entry) == 5  # greedy token is the top-1, so it is among the 5
