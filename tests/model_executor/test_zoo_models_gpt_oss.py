"""gpt-oss against transformers: attention sinks, alternating sliding-window (8 tokens,
prompts up to 40) and full layers, biased q/k/v/o, YaRN rope with ``truncate`` false,
and the MoE (router bias, softmax over the top-k logits, biased experts, clamped SwiGLU
from interleaved stacked tensors; the clamp's limit lowered so it bites).

Logits of a tiny random checkpoint, fp32, through the paged CPU backend: one prefill step
for all prompts, then chunk-then-decode steps that read the cache; with the CPU
platform's kernels installed; greedy tokens and prompt logprobs through ``pagedlm.LLM``;
two tensor-parallel ranks (gloo); and the refusals (MXFP4 checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_executor.test_tensor_parallel import paged_logits
from model_utils import PagedRunner
from pagedlm.model_executor.loader import load_model
from pagedlm_cpu.decode_layer import install_decode_kernels
from pagedlm_cpu.fused_layers import install_fused_kernels
from tiny_checkpoints import (
    PROMPT_LENS,
    hf_greedy,
    hf_logits,
    model_config,
    random_prompts,
    save_random_model,
)

BLOCK_SIZE = 4
WINDOW = 8
GPT_OSS: dict[str, Any] = {
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
    "swiglu_limit": 1.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
}
"""A two-layer gpt-oss: layer 0 slides over 8 tokens, layer 1 sees everything."""


def save_gpt_oss(path: Path) -> torch.nn.Module:
    """The tiny checkpoint in ``path``, its sinks and biases drawn large enough to matter;
    returns transformers' model (eager attention, fp32)."""
    hf_model = save_random_model(path, "GptOssConfig", GPT_OSS)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("sinks", "router.bias", "_bias")):
                param.copy_(torch.randn(param.shape, generator=generator))
    hf_model.save_pretrained(path)
    return hf_model


def paged_runner(model: torch.nn.Module) -> PagedRunner:
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf_model = save_gpt_oss(path)
    prompts = random_prompts()
    return path, hf_model, prompts, [hf_logits(hf_model, p) for p in prompts]


def test_prefill_matches_transformers(checkpoint) -> None:
    path, _, prompts, expected = checkpoint
    model = load_model(model_config(path, 128), torch.device("cpu"))
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_chunk_then_decodes_read_the_cache(checkpoint) -> None:
    """Each prompt: a first chunk, then its last 3 tokens as single-token decode steps."""
    path, _, prompts, expected = checkpoint
    model = load_model(model_config(path, 128), torch.device("cpu"))
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_with_the_cpu_platforms_kernels(checkpoint) -> None:
    """The fused norm and rotary kernels apply; the whole-layer decode kernel (Llama's
    math, no sinks) takes no layer."""
    path, _, prompts, expected = checkpoint
    model = load_model(model_config(path, 128), torch.device("cpu"))
    assert install_fused_kernels(model) > 0
    assert install_decode_kernels(model) == 0
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


@pytest.mark.parametrize("drop", ["sinks", "sliding_window"])
def test_a_dropped_feature_breaks_parity(checkpoint, drop: str) -> None:
    """The checks above see the sinks and the window: without either the logits differ."""
    path, _, prompts, expected = checkpoint
    model = load_model(model_config(path, 128), torch.device("cpu"))
    for layer in model.model.layers:
        attention = layer.self_attn.attn
        if drop == "sinks":
            attention.sinks = None
        else:
            attention._extra_kwargs.pop("sliding_window", None)
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    assert (torch.cat(got) - torch.cat(expected)).abs().max() > 1e-2


def test_expert_layout_and_parameters(checkpoint) -> None:
    """Interleaved gate/up columns land as gate rows then up rows; every parameter is
    filled (the loader checks) with the sinks under the attention layer."""
    path, hf_model, _, _ = checkpoint
    model = load_model(model_config(path, 128), torch.device("cpu"))
    moe, hf_moe = model.model.layers[1].mlp, hf_model.model.layers[1].mlp
    gate_up = hf_moe.experts.gate_up_proj[2]  # [hidden, 2I]
    torch.testing.assert_close(moe.w13[2][:96], gate_up[:, 0::2].T, atol=0, rtol=0)
    torch.testing.assert_close(moe.w13[2][96:], gate_up[:, 1::2].T, atol=0, rtol=0)
    torch.testing.assert_close(moe.w2[2], hf_moe.experts.down_proj[2].T, atol=0, rtol=0)
    attention = model.model.layers[0].self_attn.attn
    torch.testing.assert_close(attention.sinks, hf_model.model.layers[0].self_attn.sinks)
    assert attention.sliding_window == WINDOW
    assert model.model.layers[1].self_attn.attn.sliding_window is None


def test_greedy_and_prompt_logprobs_through_llm(checkpoint) -> None:
    """``pagedlm.LLM`` (continuous batching, the CPU platform's kernels): greedy tokens
    past the window equal transformers' ``generate``, prompt logprobs within 1e-4."""
    from pagedlm import LLM, SamplingParams

    path, hf_model, _, _ = checkpoint
    prompts = random_prompts([1, 9, 30], seed=3)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, 12)
    for prompt, out in zip(prompts, outs, strict=True):
        reference = torch.log_softmax(hf_logits(hf_model, prompt)[:-1], dim=-1)
        got = [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_mxfp4_checkpoints_are_refused(checkpoint, tmp_path: Path) -> None:
    path, _, _, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"MXFP4.*gpt-oss-20b-BF16"):
        load_model(model_config(tmp_path, 128), torch.device("cpu"))
    from pagedlm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"MXFP4.*gpt-oss-20b-BF16"):  # LLM's and serve's way
        EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()
    model = load_model(model_config(path, 128), torch.device("cpu"))
    blocks = [("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(4, 192, 2, 16))]
    with pytest.raises(ValueError, match=r"MXFP4.*bf16 conversion"):
        model.load_weights(blocks)


def _tensor_parallel_worker(
    rank: int, world_size: int, model_dir: str, init_file: str, out_dir: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    from pagedlm.distributed import (
        destroy_tensor_model_parallel,
        init_tensor_model_parallel,
        set_expert_parallel,
    )

    try:
        init_tensor_model_parallel(rank, world_size)
        for expert_parallel in (False, True):
            set_expert_parallel(expert_parallel)
            logits = paged_logits(model_dir, world_size)
            torch.save(logits, f"{out_dir}/ep{int(expert_parallel)}-rank{rank}.pt")
    finally:
        set_expert_parallel(False)
        destroy_tensor_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_one(checkpoint, tmp_path: Path) -> None:
    """Heads and their sinks split over two ranks (gloo), and each expert's intermediate
    slice (tensor parallel) or whole experts (expert parallel); the down and o_proj
    biases added once."""
    path, _, _, _ = checkpoint
    expected = paged_logits(str(path), 1)
    mp.spawn(
        _tensor_parallel_worker,
        args=(2, str(path), str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    for name in ("ep0-rank0", "ep0-rank1", "ep1-rank0", "ep1-rank1"):
        got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
