"""GPTQ and AWQ checkpoints on the CUDA platform's block kernels (the GGUF GEMV/GEMM) against
their dequantized weights: on CPU under ``TRITON_INTERPRET=1`` (kernels installed by hand
into the tiny model), and on the GPU end to end (``LLM``, ``-m cuda``)."""

from __future__ import annotations

import pytest
import torch
from triton_env import ON_GPU

from loader.test_int_checkpoint import CASES, _write_quantized
from model_utils import PagedRunner
from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model, quantized_linear_blocks
from pagedlm_cuda.quantized_linear import DEQUANTIZE_GGUF_ENV, GgufCudaLinear, install_gguf_kernels

PROMPTS = [[5, 17, 33, 2, 80, 41, 9, 60, 12], [7, 7, 90, 3]]
KINDS = ["gptq_sym_v1", "gptq_8bit_per_row", "awq", "w4a16_asym"]
"""Q4_0-like (a zero point of 8: the offset path), 8-bit codes, stored minimums (from float16
and bfloat16 scales)."""


def _logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    runner = PagedRunner(model, len(PROMPTS), 32, 16)
    logits = runner.step([(i, 0, p) for i, p in enumerate(PROMPTS)])
    decode = runner.step([(i, len(p), [3]) for i, p in enumerate(PROMPTS)])  # 2-row steps
    alone = runner.step([(0, len(PROMPTS[0]) + 1, [4])])  # one row: the GEMV
    rows = [torch.cat([a, b]) for a, b in zip(logits, decode, strict=True)]
    rows[0] = torch.cat([rows[0], alone[0]])
    return [r.float().log_softmax(-1) for r in rows]


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the end-to-end test instead")
@pytest.mark.parametrize("kind", KINDS)
def test_block_kernels_match_the_dequantized_weights(kind: str, tmp_path) -> None:
    _write_quantized(tmp_path, CASES[kind])
    config, _ = EngineArgs(model=str(tmp_path), dtype="float32").create_engine_config()
    with torch.no_grad():
        reference = _logprobs(load_model(config.model, torch.device("cpu")))
        model = load_model(config.model, torch.device("cpu"), keep_weight_blocks=True)
        blocks = quantized_linear_blocks(model, config.model, groups_of_16=True)
        assert install_gguf_kernels(model, blocks, max_tiled_rows=4) == len(blocks) == 8
        layer = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer.kernel, GgufCudaLinear)
        assert layer.kernel.packed.bits == (8 if "8bit" in kind else 4)
        got = _logprobs(model)
    for want, have in zip(reference, got, strict=True):
        assert (have - want).abs().max().item() < 1e-3  # float32: summation order only


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_int_checkpoints_on_the_gpu_match_their_dequantized_weights(
    kind, tmp_path, monkeypatch
) -> None:
    _write_quantized(tmp_path, CASES[kind])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": p * 3} for p in PROMPTS]

    def run() -> tuple[list[list[int]], torch.Tensor]:
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128)
        outs = llm.generate(inputs, params, use_tqdm=False)
        logprobs = [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
        return [list(o.outputs[0].token_ids) for o in outs], torch.tensor(logprobs)

    tokens, logprobs = run()
    monkeypatch.setenv(DEQUANTIZE_GGUF_ENV, "1")
    ref_tokens, ref_logprobs = run()
    difference = (logprobs - ref_logprobs).abs()
    print(f"{kind} on GPU vs dequantized: logprob diff max {difference.max():.4f}")
    assert difference.max().item() < 0.1  # bf16 rounding of the same weights
    assert [t[:4] for t in tokens] == [t[:4] for t in ref_tokens]
