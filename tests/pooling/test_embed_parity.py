"""``LLM.embed``/``encode`` against transformers (and sentence-transformers if installed) on
tiny random checkpoints: BERT with CLS and mean pooling, headless and generative decoders
with last-token pooling, prompts of mixed lengths batched together."""

from __future__ import annotations

import pytest
import torch

from embedding_checkpoints import (
    TEXTS,
    hf_hidden,
    reference_vector,
    write_bert,
    write_decoder,
)
from pagedlm import LLM, PoolingParams, PoolingRequestOutput
from pagedlm.config import PoolerConfig
from pagedlm.engine.arg_utils import EngineArgs

TOLERANCE = 1e-4
ENGINE = dict(num_kv_blocks=64, block_size=16)
TOKEN_PROMPTS = [[5, 6, 7], [1] * 20, [3, 4, 9, 100, 2, 7, 8], [42]]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOLERANCE


def _assert_distinct(vectors: list[torch.Tensor]) -> None:
    """The prompts' vectors differ (a pooler returning one row for all would pass else)."""
    for i in range(len(vectors)):
        for j in range(i):
            assert (vectors[i] - vectors[j]).abs().max().item() > 1e-3


@pytest.fixture(scope="module", params=["cls", "mean"])
def bert(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"bert-{request.param}")
    model = write_bert(path, request.param, normalize=True)
    llm = LLM(str(path), **ENGINE)
    yield request.param, path, model, llm
    llm.llm_engine.shutdown()


def test_bert_embeddings_match_transformers(bert):
    pooling, _, model, llm = bert
    expected_type = {"cls": "CLS", "mean": "MEAN"}[pooling]
    assert llm.llm_engine.config.model.pooler == PoolerConfig(expected_type, True)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    lengths = {len(tokenizer.encode(text)) for text in TEXTS}
    assert len(lengths) == len(TEXTS)  # mixed lengths in one batch
    vectors = []
    for text, output in zip(TEXTS, outputs, strict=True):
        token_ids = tokenizer.encode(text)
        assert output.prompt_token_ids == token_ids
        got = torch.tensor(output.outputs.embedding)
        _assert_close(got, reference_vector(hf_hidden(model, token_ids), pooling, True))
        assert abs(got.norm().item() - 1.0) < 1e-5
        vectors.append(got)
    _assert_distinct(vectors)


@pytest.mark.slow  # importing sentence-transformers alone takes 15-60 s on a loaded CI box
def test_bert_embeddings_match_sentence_transformers(bert):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    _, path, _, llm = bert
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    want = reference.encode(TEXTS, convert_to_tensor=True)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for output, row in zip(outputs, want, strict=True):
        _assert_close(torch.tensor(output.outputs.embedding), row.float())


def test_bert_without_sentence_transformers_config_pools_cls_normalized(tmp_path):
    model = write_bert(tmp_path, pooling=None)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.config.model.runner == "pooling"  # auto: BertModel embeds
    token_ids = llm.get_tokenizer().encode(TEXTS[1])
    (output,) = llm.embed(TEXTS[1], use_tqdm=False)
    want = reference_vector(hf_hidden(model, token_ids), "cls", True)
    _assert_close(torch.tensor(output.outputs.embedding), want)


@pytest.mark.parametrize(
    ("config_class", "model_class", "runner"),
    [
        ("Qwen3Config", "Qwen3Model", "auto"),  # Qwen3-Embedding style: no LM head
        ("LlamaConfig", "LlamaForCausalLM", "pooling"),  # a generative checkpoint, pooled
    ],
)
def test_decoder_last_token_embeddings_match_transformers(
    tmp_path, config_class, model_class, runner
):
    model = write_decoder(tmp_path, config_class, model_class)
    llm = LLM(str(tmp_path), runner=runner, skip_tokenizer_init=True, **ENGINE)
    assert llm.llm_engine.config.model.pooler == PoolerConfig("LAST", True)
    prompts = [{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS]
    outputs = llm.encode(prompts, use_tqdm=False)
    vectors = []
    for ids, output in zip(TOKEN_PROMPTS, outputs, strict=True):
        assert isinstance(output, PoolingRequestOutput)
        want = reference_vector(hf_hidden(model, ids), "lasttoken", True)
        _assert_close(output.outputs.data, want)
        vectors.append(output.outputs.data)
    _assert_distinct(vectors)
    # normalize=False gives the raw final-normed hidden state of the last token.
    (raw,) = llm.encode(prompts[2], PoolingParams(normalize=False), use_tqdm=False)
    _assert_close(raw.outputs.data, hf_hidden(model, TOKEN_PROMPTS[2])[-1])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_more_prompts_than_one_step_holds_still_match(tmp_path, async_scheduling):
    """A small token budget: prompts wait for a step with room instead of being chunked
    (also with a step in flight, as on GPUs by default)."""
    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        max_model_len=32,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
        **ENGINE,
    )
    prompts = [list(range(1 + i, 25 + i)) for i in range(5)]  # 24 tokens: one per step
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for ids, output in zip(prompts, outputs, strict=True):
        want = reference_vector(hf_hidden(model, ids), "lasttoken", True)
        _assert_close(torch.tensor(output.outputs.embedding), want)


def test_the_edge_refuses_what_pooling_cannot_do(tmp_path):
    write_decoder(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    path = str(tmp_path)
    # Mean pooling reads every row in one step: a budget below max_model_len is refused.
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        EngineArgs(
            model=path,
            runner="pooling",
            max_model_len=64,
            max_num_batched_tokens=16,
            pooler_config={"pooling_type": "MEAN"},
        ).create_engine_config()
    # Last-token pooling over causal attention reads only the last row: prompts chunk.
    chunked, _ = EngineArgs(
        model=path, runner="pooling", max_model_len=64, max_num_batched_tokens=16
    ).create_engine_config()
    assert not chunked.scheduler.whole_prompts
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="does not support speculative_config"):
        EngineArgs(model=path, runner="pooling", speculative_config=spec).create_engine_config()
    generative = LLM(path, skip_tokenizer_init=True, **ENGINE)
    with pytest.raises(ValueError, match=r"runner='pooling' \(--runner pooling\)"):
        generative.embed({"prompt_token_ids": [1, 2]}, use_tqdm=False)
    generative.llm_engine.shutdown()
    pooling = LLM(path, runner="pooling", skip_tokenizer_init=True, max_model_len=64, **ENGINE)
    config = pooling.llm_engine.config
    # Causal attention and last-token pooling: prefixes may come from the cache.
    assert config.scheduler.whole_prompts and config.cache.enable_prefix_caching
    with pytest.raises(ValueError, match=r"LLM.embed\(\)"):
        pooling.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        pooling.embed({"prompt_token_ids": [1] * 65}, use_tqdm=False)
    # A prompt of exactly max_model_len tokens has room: pooling generates nothing.
    (full,) = pooling.embed({"prompt_token_ids": [1] * 64}, use_tqdm=False)
    assert len(full.outputs.embedding) == 32


def test_a_decoder_embeds_cached_prefixes_as_transformers_does(tmp_path):
    """Last-token pooling over causal attention reads only the last row, so a prompt's
    prefix may come from the prefix cache; encoders keep computing every token."""
    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    prefix = list(range(3, 43))  # 40 tokens: two full blocks of 16
    prompts = [prefix + [50 + i, 60 + i] for i in range(3)]
    try:
        assert llm.llm_engine.config.cache.enable_prefix_caching
        first = llm.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)
        hits_before = llm.llm_engine.engine_core.make_stats().prefix_cache_hits
        rest = llm.embed([{"prompt_token_ids": p} for p in prompts[1:]], use_tqdm=False)
        hits = llm.llm_engine.engine_core.make_stats().prefix_cache_hits - hits_before
    finally:
        llm.llm_engine.shutdown()
    assert hits == 2 * 32  # both later prompts took two blocks from the cache
    for ids, output in zip(prompts, first + rest, strict=True):
        want = reference_vector(hf_hidden(model, ids), "lasttoken", True)
        _assert_close(torch.tensor(output.outputs.embedding), want)


def test_a_cache_salt_keeps_embedding_prompts_apart(tmp_path):
    """A pooling prompt's cache_salt (vLLM's, on any prompt) was dropped: salted prompts
    hit the blocks of unsalted ones and of other salts."""
    write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    ids = list(range(3, 43))  # two full blocks of 16, and 8 tokens
    stats = llm.llm_engine.engine_core.make_stats

    def hits_of(prompt: dict) -> int:
        before = stats().prefix_cache_hits
        llm.embed(prompt, use_tqdm=False)
        return stats().prefix_cache_hits - before

    try:
        assert hits_of({"prompt_token_ids": ids}) == 0
        assert hits_of({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
        assert hits_of({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0
        assert hits_of({"prompt_token_ids": ids, "cache_salt": "alice"}) == 32
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.embed({"prompt_token_ids": ids, "cache_salt": ""}, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_encoders_compute_every_token(tmp_path):
    write_bert(tmp_path, "cls")
    config = EngineArgs(model=str(tmp_path), **ENGINE).create_engine_config()[0]
    assert not config.cache.enable_prefix_caching  # bidirectional: no reusable keys


def test_pooler_config_overrides_the_checkpoints_pooling(tmp_path):
    """vLLM's --pooler-config: a decoder pooled by the mean, unnormalized."""
    from pagedlm.engine.cli_args import engine_args_from_cli
    from pagedlm.entrypoints.cli.main import parse_args

    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    args = engine_args_from_cli(parse_args(
        ["serve", str(tmp_path), "--pooler-config", '{"pooling_type": "mean", "normalize": false}']
    ))  # fmt: skip
    llm = LLM(**{**vars(args), "skip_tokenizer_init": True, **ENGINE})
    assert llm.llm_engine.config.model.pooler == PoolerConfig("MEAN", False)
    prompts = [{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS]
    for ids, output in zip(TOKEN_PROMPTS, llm.encode(prompts, use_tqdm=False), strict=True):
        _assert_close(output.outputs.data, reference_vector(hf_hidden(model, ids), "mean", False))
    llm.llm_engine.shutdown()
    for overrides, message in (
        ({"pooling_type": "MAX"}, "not served"),
        ({"step_tag_id": 5}, 'add "tok_pooling_type": "STEP"'),
        ({"dimensions": 8}, "dimensions is not supported"),
        ({"pooling": "MEAN"}, "unknown key 'pooling'"),
        ({"use_activation": False}, "applies to classifiers"),
        ({"normalize": "no"}, "true or false"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(str(tmp_path), pooler_config=overrides).create_engine_config()
    write_decoder(tmp_path / "lm", "LlamaConfig", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="pooler_config applies to pooling models"):
        EngineArgs(str(tmp_path / "lm"), pooler_config={"normalize": True}).create_engine_config()
