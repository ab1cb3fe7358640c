"""The Transformers modeling backend (model_impl): transformers' modeling code with
pagedlm's paged attention, against transformers itself on tiny random checkpoints (fp32).

GLM (partial, interleaved rotary; no pagedlm implementation) runs through ``auto``; Llama
and a windowed Mistral are forced through it. The engine runs chunked prefill (8-token
steps over 4-token blocks), prefix-cache hits and, with few blocks, preemption.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.models.transformers_backend import (
    ATTENTION_NAME,
    TransformersForCausalLM,
    paged_attention,
)
from pagedlm.model_executor.models.transformers_layers import Norm, computes_like_rmsnorm
from tiny_checkpoints import SMALL, hf_greedy, hf_logits, random_prompts, save_random_model

NEW_TOKENS = 6
LENS = [1, 7, 40, 13, 25, 2]
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
GLM = ("GlmConfig", {"head_dim": 16, "partial_rotary_factor": 0.5, **IDS})
ENGINE = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    max_model_len=128,
    block_size=4,
    max_num_batched_tokens=8,
)


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), **{**ENGINE, "num_kv_blocks": 64, **kwargs})


def _generate(llm: LLM, prompts: list[list[int]], **params):
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **params)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(prompts, sampling, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def _tolerance(llm: LLM) -> float:
    """1e-4 on CPU; GPU kernels take float32 dots in TF32 (seen: 1.1e-3 on an H200)."""
    return 1e-4 if llm.llm_engine.config.platform == "cpu" else 2e-3


def _prompt_logprobs(output, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([d[t].logprob for d, t in zip(output.prompt_logprobs[1:], prompt[1:])])


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("glm")
    hf_model = save_random_model(path, *GLM)
    prompts = random_prompts(LENS)
    prompts.append(prompts[2][:24] + prompts[3])  # shares 6 blocks with the 40-token prompt
    return path, hf_model, prompts, hf_greedy(hf_model, prompts, NEW_TOKENS)


def test_auto_runs_an_unimplemented_architecture(glm, caplog) -> None:
    path, hf_model, prompts, expected = glm
    with caplog.at_level(logging.INFO, logger="pagedlm.engine.model_impl_args"):
        llm = _llm(path)
    assert sum("Transformers modeling backend" in r.getMessage() for r in caplog.records) == 1
    assert isinstance(_model(llm), TransformersForCausalLM)
    outputs = _generate(llm, prompts, prompt_logprobs=0)
    assert _tokens(outputs) == expected
    for output, prompt in zip(outputs, prompts, strict=True):
        want = torch.log_softmax(hf_logits(hf_model, prompt), -1)[:-1]
        want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = _prompt_logprobs(output, prompt)
        torch.testing.assert_close(got, want, atol=_tolerance(llm), rtol=0)
    again = _generate(llm, prompts)  # every prompt's full blocks from the cache now
    assert _tokens(again) == expected
    assert again[LENS.index(40)].num_cached_tokens == 36
    assert again[-1].num_cached_tokens >= 24  # its prefix, shared with the 40-token prompt


def test_preemption_recomputes_the_same_tokens(glm) -> None:
    path, _, prompts, expected = glm
    llm = _llm(path, num_kv_blocks=16)  # 4-token blocks: the batch needs far more
    assert _tokens(_generate(llm, prompts)) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_transformers_builds_no_mask(glm, monkeypatch) -> None:
    """transformers makes no [T, T] mask for our implementation: the backend masks."""
    path, _, prompts, expected = glm
    masks = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return paged_attention(module, query, key, value, attention_mask, **kwargs)

    llm = _llm(path)
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, recording)
    assert _tokens(_generate(llm, prompts[:3])) == expected[:3]
    assert masks and all(mask is None for mask in masks)


def test_forced_on_llama_matches_the_native_model(tmp_path: Path) -> None:
    save_random_model(tmp_path, "LlamaConfig", {"tie_word_embeddings": True})
    prompts = random_prompts(LENS)
    native = _llm(tmp_path, model_impl="vllm")
    backend = _llm(tmp_path, model_impl="transformers")
    assert isinstance(_model(backend), TransformersForCausalLM)
    assert not isinstance(_model(native), TransformersForCausalLM)
    assert _tokens(_generate(backend, prompts)) == _tokens(_generate(native, prompts))


def test_sliding_window_beyond_the_window(tmp_path: Path) -> None:
    hf_model = save_random_model(tmp_path, "MistralConfig", {"sliding_window": 8})
    prompts = random_prompts(LENS)
    llm = _llm(tmp_path, model_impl="transformers")
    assert {m.sliding_window for m in _model(llm).attention} == {8}
    outputs = _generate(llm, prompts, prompt_logprobs=0)
    assert _tokens(outputs) == hf_greedy(hf_model, prompts, NEW_TOKENS)
    long = LENS.index(40)
    want = torch.log_softmax(hf_logits(hf_model, prompts[long]), -1)[:-1]
    want = want.gather(1, torch.tensor(prompts[long][1:])[:, None])[:, 0]
    got = _prompt_logprobs(outputs[long], prompts[long])
    torch.testing.assert_close(got, want, atol=_tolerance(llm), rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(model_impl="vllm"), "not supported by model_impl='vllm'.*--model-impl transformers"),
        (dict(model_impl="pagedlm"), "not supported by model_impl='vllm'"),
        (dict(model_impl="hf"), r"model_impl='hf' is unknown.*auto, vllm, transformers"),
        (dict(pipeline_parallel_size=2), "does not support pipeline_parallel_size above 1"),
    ],
    ids=["vllm", "pagedlm-alias", "unknown", "pp2"],
)
def test_refusals_name_the_fix(glm, kwargs, match) -> None:
    args = EngineArgs(model=str(glm[0]), skip_tokenizer_init=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()


def test_eagle_on_the_backend_is_refused(tmp_path: Path) -> None:
    from spec_decode.tiny_heads import write_eagle, write_llama

    target, head = write_llama(tmp_path / "target", 2, 0), write_eagle(tmp_path / "eagle")
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    args = EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        model_impl="transformers",
        speculative_config=spec,
    )
    with pytest.raises(
        ValueError, match=r"does not support EAGLE and MTP draft heads.*draft_model"
    ):
        args.create_engine_config()
    args.model_impl = "vllm"
    assert args.create_engine_config()[0].speculative is not None


INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton under the interpreter: the CPU only (the GPU runs the kernels)",
)


def test_auto_without_a_transformers_class_keeps_the_error(tmp_path: Path) -> None:
    save_random_model(tmp_path, "LlamaConfig", {})
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace("LlamaForCausalLM", "NoSuchForCausalLM"))
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="has no causal LM class 'NoSuchForCausalLM'"):
        args.create_engine_config()


def test_ngram_speculation_keeps_the_tokens(glm) -> None:
    path, _, prompts, expected = glm
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = _llm(path, speculative_config=spec)
    assert _tokens(_generate(llm, prompts)) == expected


def test_the_cli_flag(capsys) -> None:
    import argparse

    from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_args_from_cli(parser.parse_args([])).model_impl == "auto"
    for impl in ("auto", "vllm", "transformers", "pagedlm"):
        args = engine_args_from_cli(parser.parse_args(["--model-impl", impl]))
        assert args.model_impl == impl
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-impl", "hf"])
    assert "invalid choice: 'hf'" in capsys.readouterr().err


def test_prompt_embeds_give_the_tokens_of_their_ids(glm) -> None:
    """``enable_prompt_embeds`` on the backend: transformers' input embeddings of a prompt
    generate what its ids do (chunked over 8-token steps, beside token prompts)."""
    path, hf_model, prompts, expected = glm
    llm = _llm(path, enable_prompt_embeds=True)
    embedding = hf_model.get_input_embeddings()
    with torch.no_grad():
        embeds = [{"prompt_embeds": embedding(torch.tensor(p))} for p in prompts[2:4]]
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    mixed = embeds + [{"prompt_token_ids": prompts[0]}]
    outputs = llm.generate(mixed, sampling, use_tqdm=False)
    assert _tokens(outputs) == [*expected[2:4], expected[0]]


def test_hybrid_models_are_refused(tmp_path: Path) -> None:
    """Convolution layers (LFM2) keep state a step-wise forward does not carry: run on the
    backend they mixed one request's prompt into another's, so "auto" refuses them."""
    overrides = {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2, **IDS}
    save_random_model(tmp_path, "Lfm2Config", overrides)
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"\['conv'\] layers besides attention"):
        args.create_engine_config()


def _on_triton_cpu(path: Path, prompts: list[list[int]]):
    """Tokens on the CUDA platform's step path (Triton attention under the interpreter,
    decode steps replayed from emulated graphs), and the graph runner's replay count."""
    from spec_decode.triton_cpu import NAME, triton_cpu_platform

    with triton_cpu_platform() as platform:
        # Up to 4 requests a step: graphs at 1, 2 and 4 (64 sequences captured 11 sizes,
        # each a step under the interpreter).
        llm = _llm(path, platform=NAME, block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
        tokens = _tokens(_generate(llm, prompts))
        llm.llm_engine.shutdown()
        return tokens, sum(g.num_replays(1) for g in platform.graph_runners)


@INTERPRETER_ONLY
def test_decode_steps_replay_from_graphs(glm) -> None:
    """The backend's steps are captured like a native model's: decodes replay."""
    path, _, prompts, expected = glm
    tokens, replays = _on_triton_cpu(path, prompts[:3])
    assert tokens == expected[:3]
    assert replays > 0


@INTERPRETER_ONLY
def test_a_forward_that_cannot_be_captured_runs_eagerly(glm, monkeypatch, caplog) -> None:
    """A capture that fails (a forward reading device values on the host) leaves every
    step eager, logged once, with the same tokens."""
    from spec_decode.triton_cpu import InterpretedGraphRunner

    def refuse(self, step, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(InterpretedGraphRunner, "_record", refuse)
    path, _, prompts, expected = glm
    with caplog.at_level(logging.WARNING, logger="pagedlm_cuda.graph_runner"):
        tokens, replays = _on_triton_cpu(path, prompts[:3])
    assert tokens == expected[:3]
    assert replays == 0
    warnings = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0]


@INTERPRETER_ONLY
def test_a_native_model_that_cannot_be_captured_fails_start_up(tmp_path: Path, monkeypatch) -> None:
    """pagedlm's own models are written to be captured: their failure is an error."""
    from spec_decode.triton_cpu import InterpretedGraphRunner

    def refuse(self, step, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(InterpretedGraphRunner, "_record", refuse)
    save_random_model(tmp_path, "LlamaConfig", {})
    with pytest.raises(RuntimeError, match="operation not permitted"):
        _on_triton_cpu(tmp_path, random_prompts(LENS)[:1])


def test_linear_layers_are_pagedlms(glm) -> None:
    """transformers' nn.Linear, input embedding and LM head are pagedlm's layers (what
    platform kernels, FP8 and tensor parallelism act on); no nn.Linear is left."""
    from pagedlm.model_executor.layers.linear_base import LinearBase
    from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead

    model = _model(_llm(glm[0]))
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    # GLM: q, k, v, o, gate_up and down in each of 2 layers, and the LM head
    assert sum(isinstance(m, LinearBase) for m in model.modules()) == 2 * 6 + 1
    assert isinstance(model.hf.get_output_embeddings(), ParallelLMHead)
    # GLM's RMSNorms compute as pagedlm's: two per layer and the final one are pagedlm's,
    # and the platform's kernel serves them (the CPU's here)
    norms = [m for m in model.modules() if type(m) is Norm]
    assert len(norms) == 2 * 2 + 1 and all(n.kernel is not None for n in norms)


def test_only_norms_that_compute_alike_are_replaced() -> None:
    """The probe takes Llama's RMSNorm and leaves Gemma's (scaled by 1 + weight)."""
    llama = _meta_model("LlamaConfig").model
    gemma = _meta_model("Gemma2Config", head_dim=16).model
    assert computes_like_rmsnorm(llama.norm) == llama.config.rms_norm_eps
    assert computes_like_rmsnorm(gemma.norm) is None
    assert computes_like_rmsnorm(torch.nn.LayerNorm(8)) is None


def test_fp8_quantization_matches_the_native_model(tmp_path: Path) -> None:
    """quantization="fp8" on the backend quantizes its linear layers as the native Llama's
    (rows scaled alike, the LM head kept): the same tokens as the native FP8 model."""
    from pagedlm.model_executor.quantization.fp8 import FP8_DTYPE

    save_random_model(tmp_path, "LlamaConfig", {})
    prompts = random_prompts(LENS)
    backend = _llm(tmp_path, model_impl="transformers", quantization="fp8")
    native = _llm(tmp_path, model_impl="vllm", quantization="fp8")
    layers = _model(backend).hf.base_model.layers[0]
    assert layers.self_attn.q_proj.weight.dtype == FP8_DTYPE
    assert layers.mlp.down_proj.weight.dtype == FP8_DTYPE
    assert _model(backend).hf.get_output_embeddings().weight.dtype == torch.float32
    assert _tokens(_generate(backend, prompts)) == _tokens(_generate(native, prompts))


def _meta_model(config_class: str, **overrides):
    import transformers

    config = getattr(transformers, config_class)(**{**SMALL, **overrides})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("config_class", "overrides", "tp_size", "match"),
    [
        ("LlamaConfig", {}, 2, None),
        ("GlmConfig", {"head_dim": 16, **IDS}, 2, None),  # gate/up gathered, down splits its input
        ("LlamaConfig", {}, 4, "2 key/value heads do not split evenly over 4"),
        ("Olmo2Config", {}, 2, "keeps every attention head of layers.0.self_attn"),
        ("FalconConfig", {}, 2, "no tensor-parallel plan"),
    ],
    ids=["llama", "glm", "kv-heads", "olmo2-gathered", "no-plan"],
)
def test_tensor_parallel_plans(config_class, overrides, tp_size, match) -> None:
    from pagedlm.model_executor.models.transformers_layers import tensor_parallel_refusal

    model = _meta_model(config_class, **overrides)
    refusal = tensor_parallel_refusal(model.base_model, model.config, tp_size)
    assert refusal is None if match is None else re.search(match, refusal)
    assert tensor_parallel_refusal(model.base_model, model.config, 1) is None


def test_tensor_parallel_refusal_comes_before_the_engine(tmp_path: Path) -> None:
    save_random_model(tmp_path, "Olmo2Config", {})
    args = EngineArgs(
        model=str(tmp_path),
        skip_tokenizer_init=True,
        model_impl="transformers",
        tensor_parallel_size=2,
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: its plan keeps every attention"):
        args.create_engine_config()


def test_a_pre_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    """Only FP8 of a float checkpoint runs on the backend (no quantization package needed
    to say so)."""
    import json

    save_random_model(tmp_path, "GlmConfig", {"head_dim": 16, **IDS})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, load_format="dummy")
    with pytest.raises(
        ValueError, match=r"pre-quantized checkpoints \(this one's: fp8\).*quantization='fp8'"
    ):
        args.create_engine_config()


def test_lora_adapters_on_the_backend(glm, tmp_path: Path) -> None:
    """A PEFT adapter of GLM's own projections (its packed gate_up_proj among them): the
    tokens of transformers with the adapter merged, and the base model's beside them."""
    from pagedlm import LoRARequest
    from peft_adapters import make_adapter

    path, _, prompts, expected = glm
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    merged = make_adapter(path, tmp_path / "adapter", modules)
    llm = _llm(path, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    both = [{"prompt_token_ids": p} for p in prompts[:3]] * 2
    outputs = llm.generate(both, sampling, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    adapted = hf_greedy(merged, prompts[:3], NEW_TOKENS)
    assert _tokens(outputs) == adapted + expected[:3]
    assert adapted != expected[:3]  # the adapter changed the outputs


def test_the_pooling_runner_embeds_with_the_backend(glm) -> None:
    """runner="pooling" on a causal LM the backend runs (vLLM's --convert embed): the
    normalized last hidden state of transformers' base model, per prompt and per token."""
    path, hf_model, prompts, _ = glm
    llm = _llm(path, runner="pooling")
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts[1:3]], use_tqdm=False)
    with torch.no_grad():
        for output, prompt in zip(outputs, prompts[1:3], strict=True):
            hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
            want = torch.nn.functional.normalize(hidden[-1], dim=-1)
            got = torch.tensor(output.outputs.embedding)
            torch.testing.assert_close(got, want, atol=_tolerance(llm), rtol=0)


def test_modules_transformers_keeps_in_float32_stay_float32(tmp_path: Path) -> None:
    """A bf16 run keeps what the model class lists in ``_keep_in_fp32_modules`` (GLM-4.5's
    router weight and its correction bias) in float32, as transformers does, so experts
    are chosen as transformers chooses them."""
    import dataclasses

    from pagedlm.model_executor.loader import load_model
    from tiny_checkpoints import model_config

    save_random_model(
        tmp_path,
        "Glm4MoeConfig",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "first_k_dense_replace": 0, "head_dim": 16, "n_group": 1, "topk_group": 1},
    )  # fmt: skip
    config = dataclasses.replace(
        model_config(tmp_path, dtype=torch.bfloat16), model_impl="transformers"
    )
    model = load_model(config, torch.device("cpu"))
    kept = {
        name: tensor.dtype
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
        if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))
    }
    assert len(kept) == 4 and set(kept.values()) == {torch.float32}, kept
    assert model.hf.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
