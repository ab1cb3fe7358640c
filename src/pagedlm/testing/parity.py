"""End-to-end greedy parity with the CPU platform on tiny random checkpoints.

The checkpoints are made here with transformers (random weights, saved as safetensors;
nothing is downloaded). Each is generated from by the platform under test and by the CPU
platform, through ``LLM``, with prompts that exercise chunked prefill (a token budget
smaller than the longest prompt), prefix caching (prompts sharing two full blocks) and
mixed batches; greedy token ids must be equal.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from pagedlm.testing.promises import ConformanceFailure, NotApplicable

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Wide weights make logits peaky, so that greedy argmax has no near-ties for rounding
    # differences between implementations to flip.
    initializer_range=0.3,
)

TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral_window": ("MistralConfig", {"sliding_window": 12}),
    "gemma2_soft_cap": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 12,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 100.0,
            "query_pre_attn_scalar": 24,
        },
    ),
}
"""Grouped-query attention everywhere; a sliding window shorter than the prompts; Gemma 2's
soft-capped scores (and its alternating window)."""

BLOCK_SIZE = 16
MAX_NEW_TOKENS = 8
REFERENCE_PLATFORM = "cpu"
_reference_tokens: dict[tuple[str, str, str], list[list[int]]] = {}


def tiny_checkpoint(arch: str, directory: Path) -> Path:
    """The checkpoint ``arch`` of ``TINY_MODELS`` in ``directory/arch`` (made once)."""
    path = Path(directory) / arch
    if (path / "config.json").exists():
        return path
    import transformers

    config_class, overrides = TINY_MODELS[arch]
    config = getattr(transformers, config_class)(**{**_COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def parity_prompts(seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, _COMMON["vocab_size"], (n,), generator=generator).tolist()
        for n in (1, 7, 40, 13, 33)
    ]
    shared = 2 * BLOCK_SIZE
    for tail in (3, 11):
        extra = torch.randint(0, _COMMON["vocab_size"], (tail,), generator=generator).tolist()
        prompts.append(prompts[2][:shared] + extra)
    return prompts


def _generate(
    checkpoint: Path, platform: str, dtype: str, **engine_args
) -> tuple[list[list[int]], str]:
    """Greedy ids per prompt, and the name of the executor the engine ran."""
    from pagedlm import LLM, SamplingParams

    llm = LLM(
        str(checkpoint),
        platform=platform,
        dtype=dtype,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        **engine_args,
    )
    executor = llm.llm_engine.engine_core.executor
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in parity_prompts()]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], executor.name
    finally:
        executor.shutdown()
        del llm, executor
        gc.collect()


def check_greedy_parity(
    platform: Any, arch: str, directory: Path, attention_backend: str | None = None
) -> None:
    """``platform`` (a ``Platform``) generates ``arch``'s greedy tokens as the CPU platform
    does, or refuses a model feature its backend lacks with a ``ValueError`` naming it."""
    from pagedlm.plugins.registry import select_attention_backend

    backend_cls = select_attention_backend(platform, attention_backend)
    if platform.name == REFERENCE_PLATFORM and backend_cls.name == "cpu_sdpa":
        raise NotApplicable("the CPU platform with its own backend is the reference")
    dtype = next(
        (d for d in (torch.float32, torch.bfloat16) if d in platform.supported_dtypes), None
    )
    if dtype is None:
        raise NotApplicable(f"platform {platform.name!r} runs neither float32 nor bfloat16")
    dtype_name = str(dtype).removeprefix("torch.")
    checkpoint = tiny_checkpoint(arch, directory)
    subject = f"platform {platform.name!r} with attention backend {backend_cls.name!r}"
    try:
        tokens, executor = _generate(
            checkpoint, platform.name, dtype_name, attention_backend=attention_backend
        )
    except ValueError as exc:
        features = [f for f in ("sliding_window", "logits_soft_cap") if f in str(exc)]
        if features and not all(_supports(backend_cls, f) for f in features):
            # Refused with an error that names what is missing: the promise holds.
            raise NotApplicable(f"{subject} refuses tiny {arch}, as declared: {exc}") from exc
        raise
    if executor != platform.default_executor:
        raise ConformanceFailure(
            subject,
            "executor_choice",
            f"the engine ran executor {executor!r}, not {platform.default_executor!r}",
        )
    key = (arch, dtype_name, str(Path(directory).resolve()))
    if key not in _reference_tokens:
        _reference_tokens[key] = _generate(checkpoint, REFERENCE_PLATFORM, dtype_name)[0]
    expected = _reference_tokens[key]
    for index, (got, want) in enumerate(zip(tokens, expected)):
        if got != want:
            position = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise ConformanceFailure(
                subject,
                "greedy_parity",
                f"tiny {arch} ({dtype_name}): prompt {index} ({len(parity_prompts()[index])} "
                f"tokens) diverges at generated token {position}: {got} vs the CPU's {want}",
            )


def _supports(backend_cls: type, feature: str) -> bool:
    return bool(getattr(backend_cls, f"supports_{feature}", False))
