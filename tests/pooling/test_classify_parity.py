"""``LLM.classify`` and ``LLM.score`` against transformers on tiny random classifiers:
BERT cross-encoders (text pairs with token types 0 and 1), decoders with a ``score``
head (last-token pooling), and embedding models scoring by cosine similarity."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from embedding_checkpoints import (
    TEXTS,
    hf_hidden,
    write_bert,
    write_bert_classifier,
    write_decoder,
    write_roberta,
    write_wordpiece_tokenizer,
)
from pagedlm import LLM, PoolingParams
from pagedlm.config import ArchConfig
from pagedlm.pooling.model_config import classifier_config

TOLERANCE = 1e-4
ENGINE = dict(num_kv_blocks=64, block_size=16)
QUERY = "the quick brown fox"
DOCUMENTS = ["a cat sat on the mat", "the lazy dog", "hello world one two three"]


def _hf_logits(model, tokenizer, *texts: str, truncation=False, max_length=None, **kwargs):
    encoded = tokenizer(*texts, return_tensors="pt", truncation=truncation, max_length=max_length)
    encoded.update(kwargs)
    with torch.no_grad():
        return model(**encoded).logits[0].float()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-ce")
    model = write_bert_classifier(path, num_labels=1)
    llm = LLM(str(path), **ENGINE)
    yield model, llm
    llm.llm_engine.shutdown()


def test_a_bert_cross_encoder_scores_pairs_as_transformers_does(cross_encoder):
    model, llm = cross_encoder
    tokenizer = llm.get_tokenizer()
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert len(outputs) == len(DOCUMENTS)
    scores = []
    for document, output in zip(DOCUMENTS, outputs, strict=True):
        logit = _hf_logits(model, tokenizer, QUERY, document)
        assert output.prompt_token_ids == tokenizer(QUERY, document)["input_ids"]
        # One label, no problem_type: sigmoid, as sentence-transformers' CrossEncoder.
        assert abs(output.outputs.score - logit.sigmoid().item()) < TOLERANCE
        # The second segment's token type reaches the model: without it the logit moves.
        types_zero = torch.zeros_like(tokenizer(QUERY, document, return_tensors="pt")["input_ids"])
        assert (
            _hf_logits(model, tokenizer, QUERY, document, token_type_ids=types_zero) - logit
        ).abs().item() > 1e-3
        scores.append(output.outputs.score)
    assert len({round(s, 6) for s in scores}) == len(scores)
    raw = llm.score(QUERY, DOCUMENTS[0], pooling_params=PoolingParams(use_activation=False))
    want = _hf_logits(model, tokenizer, QUERY, DOCUMENTS[0]).item()
    assert abs(raw[0].outputs.score - want) < TOLERANCE


def test_pairs_are_one_to_many_or_element_wise(cross_encoder):
    _, llm = cross_encoder
    one_to_many = [o.outputs.score for o in llm.score([QUERY], DOCUMENTS, use_tqdm=False)]
    pairwise = llm.score([QUERY] * 3, DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(one_to_many, abs=1e-6)
    swapped = llm.score(DOCUMENTS, [QUERY] * 3, use_tqdm=False)
    assert [o.outputs.score for o in swapped] != pytest.approx(one_to_many, abs=1e-4)
    with pytest.raises(ValueError, match="data_1 has 2 items and data_2 3"):
        llm.score(DOCUMENTS[:2], DOCUMENTS)
    with pytest.raises(ValueError, match="cannot overwrite"):  # scoring pins its task
        llm.score(QUERY, DOCUMENTS[0], pooling_params=PoolingParams(task="token_classify"))
    with pytest.raises(ValueError, match="at least one item"):
        llm.score(QUERY, [])
    with pytest.raises(ValueError, match="pass strings"):
        llm.score({"prompt_token_ids": [2, 5, 3]}, DOCUMENTS[0])
    with pytest.raises(ValueError, match="does not embed"):
        llm.embed(TEXTS)
    with pytest.raises(ValueError, match="dimensions applies to embedding models"):
        llm.classify(TEXTS, pooling_params=PoolingParams(dimensions=4))


def test_a_bert_classifier_gives_softmax_probabilities(tmp_path):
    model = write_bert_classifier(tmp_path, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        assert llm.llm_engine.config.model.pooler.labels == ("neg", "neu", "pos")
        tokenizer = llm.get_tokenizer()
        outputs = llm.classify(TEXTS, use_tqdm=False)
        for text, output in zip(TEXTS, outputs, strict=True):
            want = _hf_logits(model, tokenizer, text).softmax(-1)
            assert output.outputs.num_classes == 3
            assert (torch.tensor(output.outputs.probs) - want).abs().max().item() < TOLERANCE
        with pytest.raises(ValueError, match="this classifier has 3 labels"):
            llm.score(QUERY, DOCUMENTS)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "config_class, model_class, num_labels",
    [
        ("Qwen2Config", "Qwen2ForSequenceClassification", 2),
        ("Qwen3Config", "Qwen3ForSequenceClassification", 1),
        ("LlamaConfig", "LlamaForSequenceClassification", 4),
    ],
)
def test_decoder_classifiers_match_transformers(tmp_path, config_class, model_class, num_labels):
    write_wordpiece_tokenizer(tmp_path)
    model = write_decoder(tmp_path, config_class, model_class, num_labels=num_labels)
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        assert llm.llm_engine.config.model.runner == "pooling"
        tokenizer = llm.get_tokenizer()
        outputs = llm.classify(
            TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
        )
        for text, output in zip(TEXTS, outputs, strict=True):
            want = _hf_logits(model, tokenizer, text, token_type_ids=None)
            assert (torch.tensor(output.outputs.probs) - want).abs().max().item() < TOLERANCE
        if num_labels == 1:  # a decoder cross-encoder: the tokenizer's pair, ids only
            scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
            for document, output in zip(DOCUMENTS, scores, strict=True):
                want = _hf_logits(model, tokenizer, QUERY, document, token_type_ids=None)
                assert abs(output.outputs.score - want.sigmoid().item()) < TOLERANCE
    finally:
        llm.llm_engine.shutdown()


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    model = write_bert(tmp_path, "mean", normalize=True)
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        query = hf_hidden(model, tokenizer.encode(QUERY)).mean(0)
        for document, output in zip(DOCUMENTS, outputs, strict=True):
            doc = hf_hidden(model, tokenizer.encode(document)).mean(0)
            want = F.cosine_similarity(query, doc, dim=0).item()
            assert abs(output.outputs.score - want) < TOLERANCE
            assert output.prompt_token_ids == tokenizer.encode(QUERY) + tokenizer.encode(document)
        with pytest.raises(ValueError, match="does not classify"):
            llm.classify(TEXTS)
        # vLLM's newer name for normalize: use_activation=False gives the raw vector.
        [raw] = llm.embed(TEXTS[:1], pooling_params=PoolingParams(use_activation=False))
        [unnormalized] = llm.embed(TEXTS[:1], pooling_params=PoolingParams(normalize=False))
        assert raw.outputs.embedding == unnormalized.outputs.embedding
        assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1.0) > 1e-3
        with pytest.raises(ValueError, match="disagree"):
            llm.embed(TEXTS, pooling_params=PoolingParams(use_activation=False, normalize=True))
    finally:
        llm.llm_engine.shutdown()


def test_a_cross_encoder_config_names_its_activation(tmp_path):
    """sentence-transformers' CrossEncoder config decides the activation (ms-marco's
    cross-encoders keep their raw logits: Identity)."""
    model = write_bert_classifier(tmp_path, num_labels=1)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    config_file.write_text(json.dumps(config))
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        got = llm.score(QUERY, DOCUMENTS[1], use_tqdm=False)[0].outputs.score
        assert abs(got - _hf_logits(model, tokenizer, QUERY, DOCUMENTS[1]).item()) < TOLERANCE
    finally:
        llm.llm_engine.shutdown()
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cross-encoder activation"):
        LLM(str(tmp_path), **ENGINE)


def test_a_generative_model_neither_classifies_nor_scores(tmp_path):
    write_decoder(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    try:
        with pytest.raises(ValueError, match="needs a pooling model"):
            llm.classify([{"prompt_token_ids": [1, 2]}])
        with pytest.raises(ValueError, match="needs a pooling model"):
            llm.score("a", "b")
    finally:
        llm.llm_engine.shutdown()


def test_labels_come_from_id2label_which_transformers_saves_instead_of_num_labels(tmp_path):
    write_bert_classifier(tmp_path, num_labels=5)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_labels" not in saved
    pooler = classifier_config(ArchConfig.from_directory(tmp_path))
    assert pooler.labels == tuple(f"LABEL_{i}" for i in range(5))
    assert (pooler.pooling_type, pooler.normalize, pooler.activation) == ("CLS", False, "softmax")


def test_xlm_roberta_embeds_and_reranks_as_transformers_does(tmp_path):
    """RoBERTa's positions start after the padding id (bge-m3, bge-reranker-v2-m3)."""
    embedder = write_roberta(tmp_path / "embed")
    llm = LLM(str(tmp_path / "embed"), **ENGINE)
    try:
        config = llm.llm_engine.config.model
        assert (config.runner, config.pooler.pooling_type) == ("pooling", "CLS")
        assert config.max_model_len == 64  # the table's 66 rows less pad_token_id + 1
        tokenizer = llm.get_tokenizer()
        for text, output in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False), strict=True):
            want = F.normalize(hf_hidden(embedder, tokenizer.encode(text))[0], dim=-1)
            assert (torch.tensor(output.outputs.embedding) - want).abs().max().item() < TOLERANCE
    finally:
        llm.llm_engine.shutdown()
    reranker = write_roberta(tmp_path / "rerank", num_labels=1)
    llm = LLM(str(tmp_path / "rerank"), **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        for document, output in zip(DOCUMENTS, llm.score(QUERY, DOCUMENTS), strict=True):
            assert tokenizer(QUERY, document)["input_ids"].count(2) == 3  # </s></s> between
            logit = _hf_logits(reranker, tokenizer, QUERY, document)
            assert abs(output.outputs.score - logit.sigmoid().item()) < TOLERANCE
    finally:
        llm.llm_engine.shutdown()


def test_truncate_prompt_tokens_cuts_texts_with_the_tokenizer_and_ids_from_the_left(
    cross_encoder,
):
    model, llm = cross_encoder
    tokenizer = llm.get_tokenizer()
    long_text = TEXTS[3]
    params = PoolingParams(truncate_prompt_tokens=6)
    (text_out,) = llm.classify(long_text, pooling_params=params, use_tqdm=False)
    cut = tokenizer(long_text, truncation=True, max_length=6)["input_ids"]
    assert text_out.prompt_token_ids == cut and cut[0] == tokenizer.cls_token_id
    assert cut[-1] == tokenizer.sep_token_id  # the tokenizer keeps the special tokens
    want = _hf_logits(model, tokenizer, long_text, truncation=True, max_length=6)
    assert abs(text_out.outputs.probs[0] - want.sigmoid().item()) < TOLERANCE
    ids = tokenizer.encode(long_text)
    (ids_out,) = llm.classify({"prompt_token_ids": ids}, pooling_params=params, use_tqdm=False)
    assert ids_out.prompt_token_ids == ids[-6:]
    (pair,) = llm.score(QUERY, long_text, pooling_params=params, use_tqdm=False)
    assert (
        pair.prompt_token_ids
        == tokenizer(QUERY, long_text, truncation=True, max_length=6)["input_ids"]
    )
    # vLLM's keyword does the same as the PoolingParams field.
    (keyword,) = llm.score(QUERY, long_text, truncate_prompt_tokens=6, use_tqdm=False)
    assert keyword.prompt_token_ids == pair.prompt_token_ids
    (embedded,) = llm.classify(long_text, truncate_prompt_tokens=6, use_tqdm=False)
    assert embedded.prompt_token_ids == cut
    for bad in (0, -2, 10_000):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.classify(long_text, pooling_params=PoolingParams(truncate_prompt_tokens=bad))


@pytest.mark.parametrize("words", [("no", "yes"), ("no", "yes", "maybe")])
def test_a_causal_lm_classifies_from_its_head_rows(tmp_path, words):
    """vLLM's hf_overrides for Qwen3-Reranker: the LM head's rows of the given tokens are
    the classifier; two tokens give P(second) as a sigmoid of one logit."""
    write_wordpiece_tokenizer(tmp_path, extra=("yes", "no", "maybe"))
    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3ForCausalLM")
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": list(words),
    }
    llm = LLM(str(tmp_path), hf_overrides=overrides, **ENGINE)
    try:
        assert llm.llm_engine.config.model.runner == "pooling"
        tokenizer = llm.get_tokenizer()
        ids = [tokenizer.convert_tokens_to_ids(w) for w in words]
        outputs = llm.classify(TEXTS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for text, output in zip(TEXTS, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(text)])).logits[0, -1].float()
        want = logits[ids].softmax(-1)
        got = torch.tensor(output.outputs.probs)
        if len(words) == 2:
            assert got.shape == (1,) and abs(got.item() - want[1].item()) < TOLERANCE
        else:
            assert (got - want).abs().max().item() < TOLERANCE


def test_classifier_from_token_words_must_be_single_tokens(tmp_path):
    write_wordpiece_tokenizer(tmp_path)
    write_decoder(tmp_path, "Qwen3Config", "Qwen3ForCausalLM")
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["the", "quick fox"],
    }
    with pytest.raises(ValueError, match=r"'quick fox' is 2 tokens of this tokenizer"):
        LLM(str(tmp_path), hf_overrides=overrides, **ENGINE)
