"""Prompts given as embeddings through ``LLM.generate`` (vLLM's ``prompt_embeds``).

The rows of transformers' ``get_input_embeddings()`` for some ids must generate exactly
what the ids do: for Llama, and for models that scale their embeddings afterwards (Granite's
``embedding_multiplier``, Gemma 2's normalizer) or inside their embedding layer (Gemma 3, as
vLLM),
over chunked prefill, batches mixing embeddings, ids and decodes, preemption and the
prefix cache. Tiny random fp32 checkpoints on CPU.
"""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import random_prompts, save_random_model

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=2)
ENGINE = dict(
    skip_tokenizer_init=True,
    enable_prompt_embeds=True,
    max_model_len=128,
    block_size=4,
    num_kv_blocks=128,
    max_num_batched_tokens=16,  # prompts of 25 and 40 rows chunk over several steps
)
MODELS = {
    "llama": ("LlamaConfig", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "logits_scaling": 2.0}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "layer_types": ["full_attention"] * 2}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(f"embeds-{name}")
            config_class, overrides = MODELS[name]
            made[name] = (path, save_random_model(path, config_class, overrides))
        return made[name]

    return make


def embeds(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The rows vLLM's semantics take: transformers' embedding layer, except for Gemma 1
    and 2, whose normalizer the model applies after the table's rows (transformers 5 moved
    it into the layer; Gemma 3's layer had it already, as vLLM's Gemma 3 does)."""
    layer = hf_model.get_input_embeddings()
    with torch.no_grad():
        if hf_model.config.model_type in ("gemma", "gemma2"):
            return layer.weight[torch.tensor(ids)].clone()
        return layer(torch.tensor(ids))


def assert_same(outputs, reference) -> None:
    for got, want in zip(outputs, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_row, want_row in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            for token_id, logprob in want_row.items():
                assert got_row[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_embeds_generate_what_their_ids_do(models, name):
    path, hf_model = models(name)
    prompts = random_prompts([25, 3, 40, 1])
    llm = LLM(str(path), **ENGINE)
    reference = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # A batch mixing embeddings and ids; the cache was filled by the ids, never hit.
    mixed = [
        {"prompt_embeds": embeds(hf_model, p)} if i % 2 == 0 else {"prompt_token_ids": p}
        for i, p in enumerate(prompts)
    ]
    outputs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert_same(outputs, reference)
    assert outputs[0].prompt_token_ids == [] and outputs[0].prompt is None
    assert outputs[0].num_cached_tokens == 0  # placeholder ids never match real ids


def test_a_3d_batch_of_one_and_half_precision_are_taken(models):
    path, hf_model = models("llama")
    ids = random_prompts([9])[0]
    llm = LLM(str(path), **ENGINE)
    (want,) = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    (got,) = llm.generate([{"prompt_embeds": embeds(hf_model, ids)[None]}], GREEDY, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_prefix_cache_hits_the_same_rows_only(models):
    path, hf_model = models("llama")
    first, other = random_prompts([21, 21], seed=5)
    shared = first[:12] + other[12:]  # the first 12 rows (3 blocks) of ``first``
    llm = LLM(str(path), **ENGINE)
    (a,) = llm.generate([{"prompt_embeds": embeds(hf_model, first)}], GREEDY, use_tqdm=False)
    (b,) = llm.generate([{"prompt_embeds": embeds(hf_model, first)}], GREEDY, use_tqdm=False)
    assert b.num_cached_tokens == 20  # every full block; the last token recomputed
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    (c,) = llm.generate([{"prompt_embeds": embeds(hf_model, other)}], GREEDY, use_tqdm=False)
    assert c.num_cached_tokens == 0  # the same placeholder ids, other rows
    (d,) = llm.generate([{"prompt_embeds": embeds(hf_model, shared)}], GREEDY, use_tqdm=False)
    assert d.num_cached_tokens == 12
    (want,) = llm.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)
    assert d.outputs[0].token_ids == want.outputs[0].token_ids


def test_preempted_embeds_requests_resume_with_their_rows(models):
    path, hf_model = models("llama")
    prompts = random_prompts([30, 22, 27, 18], seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    tight = {**ENGINE, "num_kv_blocks": 24, "enable_prefix_caching": False}
    llm = LLM(str(path), **tight)
    reference = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.scheduler
    before = scheduler.num_preemptions
    outputs = llm.generate(
        [{"prompt_embeds": embeds(hf_model, p)} for p in prompts], params, use_tqdm=False
    )
    assert scheduler.num_preemptions > before
    for got, want in zip(outputs, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_rows(models):
    path, hf_model = models("llama")
    ids = random_prompts([20])[0]
    llm = LLM(str(path), **ENGINE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, truncate_prompt_tokens=6)
    (want,) = llm.generate([{"prompt_token_ids": ids[-6:]}], GREEDY, use_tqdm=False)
    (got,) = llm.generate([{"prompt_embeds": embeds(hf_model, ids)}], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_truncation_side_right_keeps_the_first_rows(models):
    """vLLM cuts an embeddings prompt as it cuts token ids: ``truncation_side`` "right"
    keeps the first rows."""
    path, hf_model = models("llama")
    ids = random_prompts([20])[0]
    llm = LLM(str(path), **ENGINE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, truncate_prompt_tokens=6)
    (want,) = llm.generate([{"prompt_token_ids": ids[:6]}], GREEDY, use_tqdm=False)
    (got,) = llm.generate(
        [{"prompt_embeds": embeds(hf_model, ids)}],
        params,
        use_tqdm=False,
        tokenization_kwargs={"truncation_side": "right"},
    )
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncation_side"):
        llm.generate(
            [{"prompt_embeds": embeds(hf_model, ids)}],
            params,
            use_tqdm=False,
            tokenization_kwargs={"truncation_side": "middle"},
        )


def test_a_prompt_longer_than_the_context_is_truncated_first(models):
    """As for token ids, ``truncate_prompt_tokens`` cuts the rows before their count is
    checked against ``max_model_len`` (128 here); -1 keeps ``max_model_len`` of them."""
    path, hf_model = models("llama")
    ids = random_prompts([140], seed=3)[0]
    rows = embeds(hf_model, ids)
    llm = LLM(str(path), **ENGINE)
    params = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=12)
    (want,) = llm.generate([{"prompt_token_ids": ids[-12:]}], params, use_tqdm=False)
    (got,) = llm.generate([{"prompt_embeds": rows}], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    whole = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=-1)
    with pytest.raises(ValueError, match="max_model_len"):  # 128 rows leave no room to generate
        llm.generate([{"prompt_embeds": rows}], whole, use_tqdm=False)


def test_tokenization_kwargs_truncation_cuts_the_rows(models):
    """vLLM's renderer cuts an embeddings prompt's rows with ``tokenization_kwargs``'
    ``truncation`` and ``max_length`` as it cuts token ids (they became its
    ``truncate_prompt_tokens``); they were ignored for embeddings."""
    path, hf_model = models("llama")
    ids = random_prompts([20], seed=5)[0]
    llm = LLM(str(path), **ENGINE)
    (want,) = llm.generate([{"prompt_token_ids": ids[-6:]}], GREEDY, use_tqdm=False)
    (got,) = llm.generate(
        [{"prompt_embeds": embeds(hf_model, ids)}],
        GREEDY,
        use_tqdm=False,
        tokenization_kwargs={"truncation": True, "max_length": 6},
    )
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_bad_embeds_and_unsupported_features_are_refused(models):
    path, hf_model = models("llama")
    rows = embeds(hf_model, [1, 2, 3])
    llm = LLM(str(path), **ENGINE)
    cases = [
        ({"prompt_embeds": rows[:, :10]}, GREEDY, "hidden size"),
        ({"prompt_embeds": rows[0]}, GREEDY, "shape"),
        ({"prompt_embeds": rows.to(torch.int64)}, GREEDY, "floating point"),
        ({"prompt_embeds": rows[:0]}, GREEDY, "1 to 128"),
        ({"prompt_embeds": torch.zeros(200, 64)}, GREEDY, "1 to 128"),
        ({"prompt_embeds": rows * float("nan")}, GREEDY, "NaN"),
        ({"prompt_embeds": rows.tolist()}, GREEDY, "torch.Tensor"),
        ({"prompt_embeds": rows, "prompt_token_ids": [1]}, GREEDY, "cannot also carry"),
        ({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
        ({"prompt_embeds": rows}, SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], params, use_tqdm=False)
    from pagedlm.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="not prompt_embeds"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2, max_tokens=2))
    # The engine is unharmed.
    assert llm.generate([{"prompt_embeds": rows}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_embeds_need_the_flag(models):
    path, hf_model = models("llama")
    llm = LLM(str(path), **{**ENGINE, "enable_prompt_embeds": False})
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        llm.generate([{"prompt_embeds": embeds(hf_model, [1, 2])}], GREEDY, use_tqdm=False)


def test_a_model_without_embeds_input_refuses_the_flag_at_start_up(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*cannot take prompts as embeddings"):
        LLM(str(tiny_checkpoint("gpt2")), **ENGINE)


def test_a_lora_adapter_applies_after_the_embeddings(models, tmp_path):
    """vLLM's: an embeddings prompt with a LoRA adapter generates what its ids do with it."""
    from pagedlm import LoRARequest
    from peft_adapters import LLAMA_MODULES, make_adapter

    path, hf_model = models("llama")
    make_adapter(path, tmp_path / "adapter", LLAMA_MODULES, rank=4, seed=1)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    llm = LLM(str(path), enable_lora=True, max_lora_rank=8, **ENGINE)
    prompts = random_prompts([25, 3])
    ids = [{"prompt_token_ids": p} for p in prompts]
    reference = llm.generate(ids, GREEDY, use_tqdm=False, lora_request=lora)
    base = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in reference] != [o.outputs[0].token_ids for o in base]
    rows = [{"prompt_embeds": embeds(hf_model, p)} for p in prompts]
    assert_same(llm.generate(rows, GREEDY, use_tqdm=False, lora_request=lora), reference)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sleep_drops_the_rows_of_a_request_aborted_mid_prompt(models, async_scheduling):
    """With asynchronous scheduling the aborted request's next step is in flight when
    sleep is asked: sleep collects it (it reports nothing) instead of refusing."""
    path, hf_model = models("llama")
    llm = LLM(str(path), enable_sleep_mode=True, async_scheduling=async_scheduling, **ENGINE)
    engine = llm.llm_engine
    rows = embeds(hf_model, random_prompts([40])[0])  # three 16-token chunks
    engine.add_request("r", {"prompt_embeds": rows}, GREEDY)
    engine.step()
    runner = engine.engine_core.executor.worker.model_runner
    assert "r" in runner.prompt_embeds.rows  # its prompt is not fed whole yet
    engine.abort_request(["r"])
    llm.sleep(1)
    assert runner.prompt_embeds.rows == {}
    llm.wake_up()
    assert llm.generate([{"prompt_embeds": rows}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
