"""The pooling runner on the GPU: a decoder embedding model (causal, last-token pooling)
and BERT (the triton backend's bidirectional prefill) match transformers' float32 vectors,
and a BERT cross-encoder its scores. Run with ``-m cuda``."""

from __future__ import annotations

import pytest
import torch

from embedding_checkpoints import (
    TEXTS,
    hf_hidden,
    reference_vector,
    write_bert,
    write_bert_classifier,
    write_decoder,
)
from pagedlm import LLM

pytestmark = pytest.mark.cuda
TOKEN_PROMPTS = [[5, 6, 7], [1] * 20, [3, 4, 9, 100, 2, 7, 8], [42], list(range(1, 100))]


def test_decoder_embeddings_match_transformers_on_the_gpu(tmp_path):
    model = write_decoder(tmp_path, "Qwen3Config", "Qwen3Model")
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    assert llm.llm_engine.config.platform == "cuda"
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS], use_tqdm=False)
    for ids, output in zip(TOKEN_PROMPTS, outputs, strict=True):
        want = reference_vector(hf_hidden(model, ids), "lasttoken", True)
        got = torch.tensor(output.outputs.embedding)
        # The attention kernels' float32 dots run in tf32.
        assert (got - want).abs().max().item() < 2e-3


def test_bert_embeddings_and_cross_encoder_scores_match_transformers_on_the_gpu(tmp_path):
    model = write_bert(tmp_path / "embed", "mean")
    llm = LLM(str(tmp_path / "embed"), dtype="float32", num_kv_blocks=64)
    assert llm.llm_engine.config.platform == "cuda"
    tokenizer = llm.get_tokenizer()
    outputs = llm.embed(TEXTS, use_tqdm=False)
    llm.llm_engine.shutdown()
    for text, output in zip(TEXTS, outputs, strict=True):
        want = reference_vector(hf_hidden(model, tokenizer.encode(text)), "mean", True)
        assert (torch.tensor(output.outputs.embedding) - want).abs().max().item() < 2e-3
    scorer = write_bert_classifier(tmp_path / "score", num_labels=1)
    llm = LLM(str(tmp_path / "score"), dtype="float32", num_kv_blocks=64)
    scores = llm.score(TEXTS[1], TEXTS, use_tqdm=False)
    llm.llm_engine.shutdown()
    for text, output in zip(TEXTS, scores, strict=True):
        with torch.no_grad():
            logit = scorer(**tokenizer(TEXTS[1], text, return_tensors="pt")).logits[0, 0]
        assert abs(output.outputs.score - logit.sigmoid().item()) < 2e-3
