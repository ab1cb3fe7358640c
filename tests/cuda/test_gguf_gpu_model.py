"""A GGUF model computing on its blocks through the CUDA platform's kernels against its
dequantized weights: on CPU under ``TRITON_INTERPRET=1`` (the kernels installed by hand
into a tiny model), and on the GPU end to end (``LLM``, ``-m cuda``), with FP8 beside it."""

from __future__ import annotations

import pytest
import torch
from triton_env import ON_GPU

from model_utils import PagedRunner
from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_quantized import gguf_linear_blocks
from pagedlm_cuda.kernels.gguf_gemv_int8 import INT8_GEMV_ENV
from pagedlm_cuda.quantized_linear import DEQUANTIZE_GGUF_ENV, GgufCudaLinear, install_gguf_kernels

PROMPTS = [[5, 17, 33, 2, 80, 41, 9, 60, 12], [7, 7, 90, 3]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer llama: Q4_0 attention, Q4_1 MLP, a tied Q8_0 table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loader.tiny_gguf import tiny_causal_lm, write_gguf

    _, hf_model = tiny_causal_lm(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True)
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    path = str(tmp_path_factory.mktemp("gguf-gpu") / "tiny.gguf")
    per_layer = ["Q4_0"] * 4 + ["Q4_1"] * 3  # q, k, v, o, gate, up, down (norms stay F32)
    write_gguf(path, "llama", hf_model.config, state, ["Q8_0", *per_layer * 2],
               tokenizer_pre=None)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def tiny_k_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer llama of K-quants. Layer 1 is Q4_K_M's mix: Q4_K, with v and down
    in Q6_K (a scale per 16 columns), so qkv_proj mixes groups of 32 and 16. Layer 0 adds
    Q2_K and Q3_K (4-bit codes in groups of 16, stored and implicit minimums). The LM head
    is Q6_K. Super-block scales of 1e-4 keep weights below about 0.4, so bf16 logprobs stay
    comparable."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loader.tiny_gguf import tiny_causal_lm, write_gguf

    _, hf_model = tiny_causal_lm(
        LlamaConfig, LlamaForCausalLM, hidden_size=256, intermediate_size=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    path = str(tmp_path_factory.mktemp("gguf-gpu-k") / "tiny-k.gguf")
    layer_0 = ["Q4_K", "Q3_K", "Q6_K", "Q2_K", "Q4_K", "Q3_K", "Q2_K"]  # q k v o gate up down
    layer_1 = ["Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"]
    write_gguf(path, "llama", hf_model.config, dict(hf_model.state_dict()),
               ["Q8_0", *layer_0, *layer_1, "Q6_K"], tokenizer_pre=None, k_quant_scale=1e-4)  # fmt: skip
    return path


def _logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    runner = PagedRunner(model, len(PROMPTS), 32, 16)
    logits = runner.step([(i, 0, p) for i, p in enumerate(PROMPTS)])
    decode = runner.step([(i, len(p), [3]) for i, p in enumerate(PROMPTS)])  # 2-row steps
    return [torch.cat([a, b]).float().log_softmax(-1) for a, b in zip(logits, decode, strict=True)]


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the end-to-end test instead")
@pytest.mark.parametrize("file", ["tiny_gguf", "tiny_k_gguf"])
def test_gguf_kernels_in_a_model_match_its_dequantized_weights(file: str, request) -> None:
    """Loaded as the CUDA platform loads it: the blocks kept, the float weights of their
    layers never made (``computes_on_weight_blocks``, ``gguf_groups_of_16``)."""
    path = request.getfixturevalue(file)
    config, _ = EngineArgs(model=path, dtype="float32").create_engine_config()
    with torch.no_grad():
        reference = _logprobs(load_model(config.model, torch.device("cpu")))
        model = load_model(
            config.model, torch.device("cpu"), keep_weight_blocks=True, gguf_groups_of_16=True
        )
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        blocks = gguf_linear_blocks(model, path, groups_of_16=True)
        linears = [m for m in model.modules() if isinstance(m, LinearBase)]
        assert install_gguf_kernels(model, blocks, max_tiled_rows=4) == len(linears)
        assert all(isinstance(m.kernel, GgufCudaLinear) for m in linears)
        groups = {m.kernel.packed.group_size for m in linears}
        assert groups == ({16, 32} if file == "tiny_k_gguf" else {32})
        # Dense copies freed, but a tied table the embedding still reads.
        assert model.model.layers[0].mlp.down_proj.weight.numel() == 0
        assert (model.lm_head.weight.numel() > 0) == tied
        quantized = _logprobs(model)
    for want, got in zip(reference, quantized, strict=True):
        # Same weights; only the float32 summation order differs.
        assert (got - want).abs().max().item() < 1e-3


def _generate(path: str, prompts=PROMPTS, **kwargs) -> tuple[list[list[int]], torch.Tensor]:
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p * 3} for p in prompts], params, use_tqdm=False)
    logprobs = torch.tensor(
        [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
    )
    return [list(o.outputs[0].token_ids) for o in outs], logprobs


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("file", ["tiny_gguf", "tiny_k_gguf"])
@pytest.mark.parametrize("gemv", ["float", "int8"])
def test_gguf_on_the_gpu_matches_its_dequantized_weights(file, gemv, request, monkeypatch) -> None:
    path = request.getfixturevalue(file)
    # One request for the int8 GEMV: its decode steps are single rows, the GEMV's input
    # (two requests decode two rows at a time, through the tiled GEMM).
    prompts = PROMPTS if gemv == "float" else PROMPTS[:1]
    monkeypatch.setenv(INT8_GEMV_ENV, "1" if gemv == "int8" else "0")
    tokens, logprobs = _generate(path, prompts)
    monkeypatch.setenv(DEQUANTIZE_GGUF_ENV, "1")
    ref_tokens, ref_logprobs = _generate(path, prompts)
    difference = (logprobs - ref_logprobs).abs()
    agreement = _agreement(tokens, ref_tokens)
    print(f"GGUF on GPU ({gemv} GEMV) vs dequantized: greedy agreement {agreement:.2f}, "
          f"logprob diff max {difference.max():.4f} mean {difference.mean():.4f}")  # fmt: skip
    if gemv == "float":
        assert difference.max().item() < 0.1  # bf16 rounding of the same weights
    # The int8 GEMV serves only the decode steps (the prompt goes through the tiled GEMM),
    # so its check is the generated tokens: x rounded to int8 moves logprobs about as much
    # as bf16 does (benchmarks.int8_activations on SmolLM2: max 0.39), as the float
    # kernels' bf16 rounding does here; a broken kernel's tokens part at once.
    assert tokens[0][:4] == ref_tokens[0][:4]


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an FP8 GPU")
def test_fp8_logprobs_stay_near_bf16(tmp_path) -> None:
    from tiny_checkpoints import save_random_model

    save_random_model(tmp_path, "LlamaConfig", {"architectures": ["LlamaForCausalLM"],
                                                "hidden_size": 256, "intermediate_size": 512,
                                                "max_position_embeddings": 256})  # fmt: skip
    tokens, logprobs = _generate(str(tmp_path), quantization="fp8")
    ref_tokens, ref_logprobs = _generate(str(tmp_path))
    difference = (logprobs - ref_logprobs).abs()
    agreement = _agreement(tokens, ref_tokens)
    print(f"FP8 vs bf16: greedy agreement {agreement:.2f}, prompt logprob diff max "
          f"{difference.max():.4f} mean {difference.mean():.4f}")  # fmt: skip
    # Not identity: W8A8 moves a random model's near-tied logits, so greedy paths part
    # early. The same quantization emulated on the CPU (the reference linear layers)
    # gives on this model: greedy agreement 0.12, prompt logprob difference max 0.63,
    # mean 0.20; the H200: 0.06, 0.58 and 0.17 (its second prompt's first token already
    # flips). A broken kernel is nats off.
    assert difference.max().item() < 1.0 and difference.mean().item() < 0.3


def test_the_cuda_platform_keeps_gguf_blocks_unless_asked_not_to(tiny_gguf, monkeypatch) -> None:
    from pagedlm_cuda.platform import CudaPlatform

    config, _ = EngineArgs(model=tiny_gguf, dtype="float32").create_engine_config()
    platform = CudaPlatform()
    assert platform.computes_on_weight_blocks(config.model) and platform.gguf_groups_of_16
    monkeypatch.setenv(DEQUANTIZE_GGUF_ENV, "1")
    assert not platform.computes_on_weight_blocks(config.model)
