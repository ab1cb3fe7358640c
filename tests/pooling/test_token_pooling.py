"""Token-wise pooling (vLLM's ``token_embed`` / ``token_classify``, ``LLM.reward``) against
transformers on tiny random checkpoints: token classifiers and a process reward model
(every token's head logits), a sequence classifier's head at every token, an embedding
model's per-token normalized hidden states; prompts chunked over several steps, a cached
prefix recomputed, STEP pooling, and the errors naming the tasks a model serves."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from embedding_checkpoints import (
    TEXTS,
    hf_hidden,
    write_bert,
    write_decoder,
    write_wordpiece_tokenizer,
)
from pagedlm import LLM, PoolingParams

TOLERANCE = 1e-4
ENGINE = dict(num_kv_blocks=64, block_size=16)
LONG = list(range(3, 33)) + list(range(40, 50))
"""40 token ids: five chunks of an 8-token step budget."""


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (got - want).abs().max().item() < TOLERANCE


def _hf_token_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len, num_labels] float32: a token classifier's logits at every token."""
    with torch.no_grad():
        ids = torch.tensor([token_ids])
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


@pytest.fixture(scope="module")
def token_classifier(tmp_path_factory):
    """A ``LlamaForTokenClassification`` (3 labels, biased head) with a step budget of 8
    tokens, so longer prompts run in chunks."""
    path = tmp_path_factory.mktemp("llama-tokcls")
    write_wordpiece_tokenizer(path)
    model = write_decoder(path, "LlamaConfig", "LlamaForTokenClassification", num_labels=3)
    llm = LLM(str(path), max_num_batched_tokens=8, **ENGINE)
    yield model, llm
    llm.llm_engine.shutdown()


def test_a_token_classifier_rewards_every_token_as_transformers_does(token_classifier):
    model, llm = token_classifier
    config = llm.llm_engine.config
    assert config.model.runner == "pooling"
    # Token-wise only: nothing to take from the prefix cache; prompts chunk at 8 tokens.
    assert not config.cache.enable_prefix_caching
    assert not config.scheduler.whole_prompts
    tokenizer = llm.get_tokenizer()
    outputs = llm.reward(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 8  # some ran over several steps
    for text, output in zip(TEXTS, outputs, strict=True):
        ids = tokenizer.encode(text)
        assert output.prompt_token_ids == ids
        _close(output.outputs.data, _hf_token_logits(model, ids).softmax(-1))
    raw = llm.encode(
        [{"prompt_token_ids": LONG}],
        PoolingParams(use_activation=False),
        pooling_task="token_classify",
        use_tqdm=False,
    )
    _close(raw[0].outputs.data, _hf_token_logits(model, LONG))


def test_a_model_refuses_the_tasks_it_does_not_serve(token_classifier):
    _, llm = token_classifier
    served = r"serves the tasks \['token_classify'\]"
    for call in (
        lambda: llm.embed(TEXTS),
        lambda: llm.classify(TEXTS),
        lambda: llm.encode(TEXTS, pooling_task="token_embed"),
        lambda: llm.encode(TEXTS, pooling_task="embed"),
    ):
        with pytest.raises(ValueError, match=served):
            call()
    with pytest.raises(ValueError, match="pooling task 'token_reward' is unknown"):
        llm.encode(TEXTS, pooling_task="token_reward")
    with pytest.raises(ValueError, match="cannot overwrite"):
        llm.reward(TEXTS, pooling_params=PoolingParams(task="classify"))
    with pytest.raises(ValueError, match="dimensions applies to embedding models"):
        llm.reward(TEXTS, pooling_params=PoolingParams(dimensions=2))
    with pytest.raises(ValueError, match="apply to STEP pooling"):
        llm.reward(TEXTS, pooling_params=PoolingParams(step_tag_id=5))


@pytest.mark.parametrize(
    "config_class, model_class, num_labels",
    [
        ("Qwen2Config", "Qwen2ForTokenClassification", 2),
        ("Qwen3Config", "Qwen3ForTokenClassification", 1),
    ],
)
def test_qwen_token_classifiers_match_transformers(tmp_path, config_class, model_class, num_labels):
    model = write_decoder(tmp_path, config_class, model_class, num_labels=num_labels)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    try:
        prompts = [[5, 6, 7], LONG, [42]]
        outputs = llm.reward([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
        for ids, output in zip(prompts, outputs, strict=True):
            logits = _hf_token_logits(model, ids)
            # One label: a sigmoid per token (vLLM's activation for a token head of one).
            want = logits.sigmoid() if num_labels == 1 else logits.softmax(-1)
            _close(output.outputs.data, want)
    finally:
        llm.llm_engine.shutdown()


def test_a_sequence_classifier_also_classifies_every_token(tmp_path):
    write_wordpiece_tokenizer(tmp_path)
    model = write_decoder(tmp_path, "Qwen2Config", "Qwen2ForSequenceClassification", num_labels=2)
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        params = PoolingParams(use_activation=False)
        tokens = llm.reward(TEXTS, pooling_params=params, use_tqdm=False)
        vectors = llm.classify(TEXTS, pooling_params=params, use_tqdm=False)
        for text, token_output, vector in zip(TEXTS, tokens, vectors, strict=True):
            ids = tokenizer.encode(text)
            with torch.no_grad():
                want = model.score(hf_hidden(model, ids))
            _close(token_output.outputs.data, want)
            # The sequence task is the last token's row.
            _close(torch.tensor(vector.outputs.probs), want[-1])
        with pytest.raises(ValueError, match=r"serves the tasks \['classify', 'token_classify'\]"):
            llm.encode(TEXTS, pooling_task="token_embed")
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory):
    """A ``Qwen3Model`` embedding checkpoint (last-token pooling, prefix caching on)."""
    path = tmp_path_factory.mktemp("qwen3-embed")
    model = write_decoder(path, "Qwen3Config", "Qwen3Model")
    llm = LLM(str(path), skip_tokenizer_init=True, **ENGINE)
    yield model, llm
    llm.llm_engine.shutdown()


def test_an_embedding_model_embeds_every_token(decoder_embedder):
    model, llm = decoder_embedder
    prompts = [[5, 6, 7], LONG, [42]]
    outputs = llm.encode(
        [{"prompt_token_ids": ids} for ids in prompts], pooling_task="token_embed", use_tqdm=False
    )
    for ids, output in zip(prompts, outputs, strict=True):
        _close(output.outputs.data, F.normalize(hf_hidden(model, ids), dim=-1))
    [raw] = llm.encode(
        {"prompt_token_ids": LONG}, PoolingParams(normalize=False), pooling_task="token_embed"
    )
    _close(raw.outputs.data, hf_hidden(model, LONG))
    with pytest.raises(ValueError, match=r"serves the tasks \['embed', 'token_embed', 'score'\]"):
        llm.reward({"prompt_token_ids": LONG})


def test_a_token_wise_request_recomputes_a_cached_prefix(decoder_embedder):
    """vLLM skips reading the prefix cache for token-wise requests: the cached part of a
    prompt has no hidden states in the step."""
    model, llm = decoder_embedder
    assert llm.llm_engine.config.cache.enable_prefix_caching
    prompt = {"prompt_token_ids": LONG}
    llm.embed(prompt, use_tqdm=False)
    [again] = llm.encode(prompt, pooling_task="embed", use_tqdm=False)
    assert again.num_cached_tokens == 32  # two full blocks of 16 from the cache
    [tokens] = llm.encode(prompt, pooling_task="token_embed", use_tqdm=False)
    assert tokens.num_cached_tokens == 0
    _close(tokens.outputs.data, F.normalize(hf_hidden(model, LONG), dim=-1))


def test_sequence_and_token_wise_requests_share_chunked_steps(tmp_path):
    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_num_batched_tokens=8, **ENGINE)
    try:
        assert not llm.llm_engine.config.scheduler.whole_prompts
        prompts = [{"prompt_token_ids": ids} for ids in (LONG, LONG[:13], LONG[5:27])]
        tasks = ["token_embed", "embed", "token_embed"]
        outputs = llm.encode(prompts, [PoolingParams(task=t) for t in tasks], use_tqdm=False)
        for prompt, task, output in zip(prompts, tasks, outputs, strict=True):
            want = F.normalize(hf_hidden(model, prompt["prompt_token_ids"]), dim=-1)
            _close(output.outputs.data, want if task == "token_embed" else want[-1])
    finally:
        llm.llm_engine.shutdown()


def test_an_encoder_embeds_every_token(tmp_path):
    model = write_bert(tmp_path, "cls", normalize=True)
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        outputs = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
        for text, output in zip(TEXTS, outputs, strict=True):
            want = F.normalize(hf_hidden(model, tokenizer.encode(text)), dim=-1)
            _close(output.outputs.data, want)
    finally:
        llm.llm_engine.shutdown()


def test_a_bert_classifier_classifies_every_token_with_its_classifier_alone(tmp_path):
    """vLLM's token_classify on BERT: ``classifier(hidden)`` per token; BERT's pooler layer
    (tanh(dense)) reads only the CLS row of the sequence form."""
    from embedding_checkpoints import write_bert_classifier

    model = write_bert_classifier(tmp_path, 3)
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        raw = PoolingParams(use_activation=False)
        outputs = llm.reward(TEXTS, pooling_params=raw, use_tqdm=False)
        for text, output in zip(TEXTS, outputs, strict=True):
            ids = torch.tensor([tokenizer.encode(text)])
            with torch.no_grad():
                hidden = model.bert(input_ids=ids).last_hidden_state[0]
                want = model.classifier(hidden).float()
            _close(output.outputs.data, want)
    finally:
        llm.llm_engine.shutdown()


def test_step_pooling_keeps_the_step_tags_rows_and_the_returned_columns(tmp_path):
    """vLLM's STEP pooling (math-shepherd style): the rows of the positions holding
    ``step_tag_id``, the ``returned_token_ids`` columns, softmax over those."""
    model = write_decoder(tmp_path, "LlamaConfig", "LlamaForTokenClassification", num_labels=4)
    tag = 9
    pooler_config = {"pooling_type": "STEP", "step_tag_id": tag, "returned_token_ids": [3, 1]}
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        pooler_config=pooler_config,
        max_num_batched_tokens=8,
        **ENGINE,
    )
    try:
        ids = [5, 6, tag, 7, 8, 10, 11, tag, 12, 13, 14, 15, 16, 17, 18, 19, 20, tag]
        [output] = llm.reward({"prompt_token_ids": ids}, use_tqdm=False)
        logits = _hf_token_logits(model, ids)
        rows = [i for i, token in enumerate(ids) if token == tag]
        _close(output.outputs.data, logits[rows][:, [3, 1]].softmax(-1))
        # A request's own tag and columns; one column left gets a sigmoid.
        params = PoolingParams(step_tag_id=7, returned_token_ids=[2])
        [mine] = llm.reward({"prompt_token_ids": ids}, pooling_params=params, use_tqdm=False)
        _close(mine.outputs.data, logits[[3]][:, [2]].sigmoid())
        [none] = llm.reward({"prompt_token_ids": [5, 6]}, use_tqdm=False)
        assert none.outputs.data.shape == (0, 2)
        with pytest.raises(ValueError, match=r"column indices in \[0, 4\)"):
            llm.reward(
                {"prompt_token_ids": ids}, pooling_params=PoolingParams(returned_token_ids=[4])
            )
    finally:
        llm.llm_engine.shutdown()


def test_a_process_reward_model_scores_its_step_tags(tmp_path):
    """``Qwen2ForProcessRewardModel`` (Qwen2.5-Math-PRM): a two-layer head, STEP pooling
    by default (every row without a tag), the saved LM head ignored."""
    base = write_decoder(tmp_path, "Qwen2Config", "Qwen2ForCausalLM")
    hidden = base.config.hidden_size
    torch.manual_seed(1)
    head = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )
    weights = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" in weights
    weights.update({f"score.{name}": t.detach() for name, t in head.state_dict().items()})
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForProcessRewardModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    try:
        pooler = llm.llm_engine.config.model.pooler
        assert (pooler.tok_pooling_type, pooler.labels) == ("STEP", ("LABEL_0", "LABEL_1"))
        with torch.no_grad():
            want = head(hf_hidden(base, LONG)).softmax(-1)
        [every] = llm.reward({"prompt_token_ids": LONG}, use_tqdm=False)
        _close(every.outputs.data, want)
        tagged = PoolingParams(step_tag_id=LONG[7])
        [steps] = llm.reward({"prompt_token_ids": LONG}, pooling_params=tagged, use_tqdm=False)
        _close(steps.outputs.data, want[[7]])
    finally:
        llm.llm_engine.shutdown()
