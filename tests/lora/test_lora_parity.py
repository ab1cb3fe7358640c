"""LoRA end to end on CPU: greedy tokens equal transformers with the adapter merged.

Tiny random checkpoints and random PEFT adapters (fp32). Llama and Qwen3 adapt the seven
separate projections (pagedlm's fused qkv/gate_up layers take them as slices); Phi-3's
checkpoints fuse qkv_proj and gate_up_proj themselves, so its adapter covers whole fused
layers. The mixed batch runs 4 adapters and the base model in the same steps and must give
every request its solo tokens.
"""

from __future__ import annotations

import random

import pytest

from pagedlm import LLM, LoRARequest, SamplingParams
from peft_adapters import LLAMA_MODULES, PHI3_MODULES, make_adapter
from tiny_checkpoints import hf_greedy, load_hf_model

NEW_TOKENS = 8
CASES = {
    # case: (checkpoint, target modules, adapter options, LLM options, prompt lengths)
    "llama": ("llama", LLAMA_MODULES, {}, {}, [1, 5, 23, 40]),
    "qwen3_rslora_r4": (
        "qwen3",
        LLAMA_MODULES,
        {"rank": 4, "alpha": 8.0, "use_rslora": True},
        {},
        [3, 17, 33],
    ),
    "phi3_fused": ("phi3_longrope", PHI3_MODULES, {}, {"max_model_len": 64}, [2, 19, 40]),
}


def _prompts(lens: list[int], vocab_size: int = 384) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def _greedy(llm: LLM, prompts, lora_request=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=lora_request,
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_merged_adapter(tiny_checkpoint, tmp_path, case):
    checkpoint, modules, adapter_options, llm_options, lens = CASES[case]
    base = tiny_checkpoint(checkpoint)
    merged = make_adapter(base, tmp_path / "adapter", modules, **adapter_options)
    prompts = _prompts(lens)
    llm = LLM(
        str(base),
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=8,
        num_kv_blocks=64,
        **llm_options,
    )
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))

    got = _greedy(llm, prompts, lora)
    assert got == hf_greedy(merged, prompts, NEW_TOKENS)
    base_tokens = _greedy(llm, prompts)
    assert base_tokens == hf_greedy(load_hf_model(base), prompts, NEW_TOKENS)
    assert got != base_tokens  # the adapter changed the outputs


def test_mixed_batch_gives_every_request_its_solo_tokens(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    loras = []
    for index, rank in enumerate([8, 4, 2, 8]):
        path = tmp_path / f"adapter{index}"
        make_adapter(base, path, LLAMA_MODULES[index % 3 :], rank=rank, seed=index + 1)
        loras.append(LoRARequest(f"a{index}", index + 1, str(path)))
    prompts = _prompts([1, 9, 30, 17, 4, 25])
    per_prompt = [*loras, None, loras[0]]
    llm = LLM(str(base), skip_tokenizer_init=True, enable_lora=True, max_loras=4, num_kv_blocks=96)

    mixed = _greedy(llm, prompts, per_prompt)
    solo = [_greedy(llm, [p], lora)[0] for p, lora in zip(prompts, per_prompt, strict=True)]
    assert mixed == solo
    base_tokens = _greedy(llm, prompts)
    changed = [m != b for m, b, lora in zip(mixed, base_tokens, per_prompt) if lora is not None]
    assert all(changed)
    assert mixed[4] == base_tokens[4]  # the base-model request in the mixed batch
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    one = SamplingParams(max_tokens=1)
    outputs = llm.generate(token_prompts, one, use_tqdm=False, lora_request=per_prompt)
    assert [o.lora_request for o in outputs] == per_prompt  # vLLM's RequestOutput field
