"""The CPU platform's decoder-layer kernel (``pagedlm_cpu/decode_layer.py``): it computes
the steps of decodes only, and greedy tokens and logprobs are bitwise those of the modules
(``PAGEDLM_CPU_FAST_DECODE=0``), where it runs and where it declines."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.models.llama import LlamaDecoderLayer
from pagedlm_cpu import linear as cpu_linear
from pagedlm_cpu.decode_layer import FAST_DECODE_ENV, DecodeLayerKernel, install_decode_kernels
from pagedlm_cpu.quantized_linear import int4_kernel_available
from tiny_checkpoints import random_prompts, save_random_model

NEW_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory) -> str:
    """A random 2-layer llama written like SmolLM2's file: Q4_1 layers (torch's int4
    kernel, called directly by the decode kernel in bf16), a tied Q8_0 table."""
    if not int4_kernel_available():
        pytest.skip("no CPU int4 kernel")
    from transformers import LlamaConfig, LlamaForCausalLM

    from loader.tiny_gguf import tiny_causal_lm, write_gguf

    _, hf_model = tiny_causal_lm(
        LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True, vocab_size=320
    )
    state_dict = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    path = str(tmp_path_factory.mktemp("decode-q4") / "tiny-q4_1.gguf")
    write_gguf(path, "llama", hf_model.config, state_dict, ["Q8_0"] + ["Q4_1"] * 14,
               tokenizer_pre=None)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, q4_gguf) -> dict[str, str]:
    """Float Llama and Qwen3 (q/k norms) checkpoints, and the Q4_1 GGUF."""
    made = {"q4_1": q4_gguf}
    for name, config_class, overrides in (
        ("llama", "LlamaConfig", {}),
        ("qwen3", "Qwen3Config", {"head_dim": 16}),
    ):
        path = tmp_path_factory.mktemp(f"decode-{name}")
        save_random_model(path, config_class, overrides)
        made[name] = str(path)
    return made


class Counted:
    """A layer's kernel, counting the calls it computed and those it declined."""

    def __init__(self, kernel: DecodeLayerKernel) -> None:
        self.kernel = kernel
        self.ran = 0
        self.declined = 0

    def __call__(self, *args):
        out = self.kernel(*args)
        if out is None:
            self.declined += 1
        else:
            self.ran += 1
        return out


def _layers(llm: LLM) -> list[LlamaDecoderLayer]:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def _llm(monkeypatch, path: str, fast: bool, **kwargs) -> LLM:
    monkeypatch.setenv(FAST_DECODE_ENV, "1" if fast else "0")
    args = dict(
        skip_tokenizer_init=True, max_model_len=128, num_kv_blocks=64, enable_prefix_caching=False
    )
    llm = LLM(path, **{**args, **kwargs})
    for layer in _layers(llm):
        if fast:
            assert isinstance(layer.kernel, DecodeLayerKernel)
            layer.set_kernel(Counted(layer.kernel))
        else:
            assert layer.kernel is None
    return llm


def _results(llm: LLM, prompts: list[list[int]]):
    """Per request: its token ids and, per token, the sorted (token, logprob) of its top 3."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [
        (
            list(out.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in top.items()) for top in out.outputs[0].logprobs],
        )
        for out in outs
    ]


def _counts(llm: LLM) -> tuple[int, int]:
    """(calls computed, calls declined) summed over the layers."""
    kernels = [layer.kernel for layer in _layers(llm)]
    return sum(k.ran for k in kernels), sum(k.declined for k in kernels)


def _compare(monkeypatch, path: str, prompts: list[list[int]], **kwargs) -> tuple[int, int]:
    """Runs ``prompts`` with the kernel and without; asserts bitwise-equal results and
    returns the kernel's counts."""
    fast = _llm(monkeypatch, path, True, **kwargs)
    got = _results(fast, prompts)
    counts = _counts(fast)
    want = _results(_llm(monkeypatch, path, False, **kwargs), prompts)
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in want)
    assert got == want
    return counts


@pytest.mark.parametrize("model", ["q4_1", "llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_1_runs_the_kernel_and_matches_the_modules_bitwise(
    monkeypatch, checkpoints, model, dtype
):
    ran, declined = _compare(monkeypatch, checkpoints[model], random_prompts([21]), dtype=dtype)
    # Two layers: the prompt's step declines, every decode step after it runs.
    assert (ran, declined) == (2 * (NEW_TOKENS - 1), 2)


@pytest.mark.parametrize("model", ["q4_1", "llama"])
def test_a_batch_of_decodes_runs_the_kernel(monkeypatch, checkpoints, model):
    """Four requests of different lengths: one SDPA call with a key mask over gathered
    blocks. The prompts fill one step, so every later step is decodes only."""
    prompts = random_prompts([3, 40, 17, 9])
    ran, declined = _compare(monkeypatch, checkpoints[model], prompts, dtype="bfloat16")
    assert (ran, declined) == (2 * (NEW_TOKENS - 1), 2)


def test_past_the_int4_rows_the_layers_own_kernels_run(monkeypatch, checkpoints):
    """17 decodes per step: the Q4_1 layers compute on their dense copies (from 16 rows),
    called through the layers' kernels as the modules call them."""
    prompts = random_prompts([5 + i for i in range(17)])
    ran, declined = _compare(
        monkeypatch, checkpoints["q4_1"], prompts, dtype="bfloat16", max_num_seqs=32
    )
    assert (ran, declined) == (2 * (NEW_TOKENS - 1), 2)


def test_steps_with_a_prompt_chunk_decline(monkeypatch, checkpoints):
    """16-token steps: the long prompt's chunks share steps with the short one's decodes
    (declined: the modules run them), then both decode (the kernel runs them)."""
    prompts = random_prompts([3, 60])
    ran, declined = _compare(
        monkeypatch, checkpoints["q4_1"], prompts, dtype="bfloat16", max_num_batched_tokens=16
    )
    # Five steps carry the long prompt (13 + 15 + 15 + 15 + 2 tokens, beside the short
    # one's prompt, then its decodes); its 11 decode steps are decodes only.
    assert (ran, declined) == (2 * (NEW_TOKENS - 1), 2 * 5)


@pytest.mark.parametrize(
    "kwargs", [{"kv_cache_dtype": "fp8"}, {"batch_invariant": True}], ids=["fp8", "invariant"]
)
def test_an_fp8_cache_and_batch_invariant_mode_decline(monkeypatch, checkpoints, kwargs):
    ran, declined = _compare(
        monkeypatch, checkpoints["q4_1"], random_prompts([21]), dtype="bfloat16", **kwargs
    )
    assert (ran, declined) == (0, 2 * NEW_TOKENS)


def test_a_linear_kernel_replaced_after_installation_declines(monkeypatch, checkpoints):
    """LoRA and batch-invariant mode wrap the layers' kernels after the platform has
    installed its own: the decode kernel then leaves the layer to the modules."""
    llm = _llm(monkeypatch, checkpoints["q4_1"], True, dtype="bfloat16")
    want = _results(llm, random_prompts([21]))
    assert _counts(llm)[0] > 0
    for layer in _layers(llm):
        layer.kernel.ran = layer.kernel.declined = 0
        down = layer.mlp.down_proj
        inner = down.kernel
        down.set_kernel(lambda x, inner=inner: inner(x))
    assert _results(llm, random_prompts([21])) == want
    assert _counts(llm) == (0, 2 * NEW_TOKENS)


def test_layers_it_cannot_compute_get_no_kernel(tmp_path):
    """Sliding windows (and the other features the kernel does not reproduce) keep the
    modules; the kernel is installed only where every piece is one it computes."""
    save_random_model(tmp_path, "MistralConfig", {"sliding_window": 8})
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=128, num_kv_blocks=64)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert [layer.kernel for layer in _layers(llm)] == [None, None]
    assert install_decode_kernels(model) == 0


def test_layers_without_a_kernel_compute_with_f_linear(monkeypatch, checkpoints):
    """Without oneDNN the float layers keep no kernel: the decode kernel then calls
    ``F.linear`` on their weights, as ``LinearBase.apply_linear`` does."""
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    prompts = random_prompts([21])
    fast = _llm(monkeypatch, checkpoints["llama"], True)
    model = fast.llm_engine.engine_core.executor.worker.model_runner.model
    assert all(m.kernel is None for m in model.modules() if isinstance(m, LinearBase))
    got = _results(fast, prompts)
    assert _counts(fast) == (2 * (NEW_TOKENS - 1), 2)
    assert got == _results(_llm(monkeypatch, checkpoints["llama"], False), prompts)


@pytest.mark.slow
def test_smollm2_batch_1_matches_the_modules_bitwise(monkeypatch, smollm2_path):
    """The embedded model (Q4_1 layers, a tied Q8_0 table, 30 layers) in bf16, as
    ``LLM()`` runs it on a CPU with native bf16."""
    prompts = [list(range(1000, 1064))]
    ran, declined = _compare(monkeypatch, smollm2_path, prompts, dtype="bfloat16")
    assert (ran, declined) == (30 * (NEW_TOKENS - 1), 30)
