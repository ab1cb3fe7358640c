"""PEFT adapters on the LayerNorm decoder families (their merged q/k/v and gate/up layers
are named by dotted ``stacked_params``, their other projections by the checkpoint renames)
and on the attention of gpt-oss and Qwen2-MoE: transformers' tokens with the adapter
merged; GPT-NeoX is refused, and so is a module the architecture lacks."""

from __future__ import annotations

import pytest

from pagedlm import LLM, LoRARequest, SamplingParams
from peft_adapters import make_adapter
from tiny_checkpoints import hf_greedy, random_prompts, save_random_model

CASES = {
    "StableLmConfig": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
    "CohereConfig": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "PhiConfig": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],  # Phi's own names
    "Starcoder2Config": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
    # MoE models adapt their attention only.
    "GptOssConfig": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "Qwen2MoeConfig": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
OVERRIDES = {"GptOssConfig": {"num_local_experts": 4}}


@pytest.mark.parametrize("config_class", list(CASES))
def test_adapter_tokens_match_the_merged_model(tmp_path, config_class) -> None:
    save_random_model(tmp_path / "model", config_class, OVERRIDES.get(config_class, {}))
    merged = make_adapter(tmp_path / "model", tmp_path / "adapter", CASES[config_class])
    prompts = random_prompts([9, 5])
    llm = LLM(str(tmp_path / "model"), skip_tokenizer_init=True, dtype="float32",
              enable_lora=True, max_lora_rank=8)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(merged, prompts, 6)


def test_gpt_neox_is_refused(tmp_path) -> None:
    save_random_model(tmp_path, "GPTNeoXConfig", {"num_key_value_heads": None})
    with pytest.raises(ValueError, match="query_key_value, which interleaves"):
        LLM(str(tmp_path), skip_tokenizer_init=True, enable_lora=True)


def test_a_module_the_architecture_lacks_fails_its_own_request(tmp_path) -> None:
    """A Phi adapter renamed to target gate_proj (Phi has none; its fc1 has that shape) is
    refused when the request arrives, and the engine serves the next request."""
    from safetensors.torch import load_file, save_file

    save_random_model(tmp_path / "model", "PhiConfig", {})
    make_adapter(tmp_path / "model", tmp_path / "adapter", ["fc1"])
    weights_file = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    save_file({k.replace(".mlp.fc1.", ".mlp.gate_proj."): v for k, v in tensors.items()},
              weights_file)  # fmt: skip
    llm = LLM(str(tmp_path / "model"), skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=8)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=2)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="gate_proj' does not exist in PhiForCausalLM"):
        llm.generate([{"prompt_token_ids": [5, 6]}], params, lora_request=lora)
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], params)[0].outputs[0].token_ids) == 2
