"""BERT-family encoders on the CUDA platform's step path, run on the CPU (the Triton
attention backend under ``TRITON_INTERPRET=1``, ``spec_decode/triton_cpu.py``): the
prefill kernel's bidirectional mode gives transformers' embeddings and cross-encoder
scores, prompts of one length (a uniform step) and of mixed lengths alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embedding_checkpoints import hf_hidden, write_bert, write_bert_classifier
from pagedlm import LLM
from spec_decode.triton_cpu import NAME, ON_GPU, triton_cpu_platform

pytestmark = pytest.mark.skipif(ON_GPU, reason="the interpreter runs on the CPU only")
TOLERANCE = 1e-4
# Two of one length (a uniform step), then mixed lengths.
TEXTS = ["the quick brown fox", "a cat sat on", "hello", "one two three four five one two"]


def _llm(path) -> LLM:
    return LLM(str(path), platform=NAME, dtype="float32", block_size=16, num_kv_blocks=32)


def test_bert_embeddings_on_the_triton_backend_match_transformers(tmp_path):
    model = write_bert(tmp_path, "mean", normalize=True)
    with triton_cpu_platform():
        llm = _llm(tmp_path)
        try:
            tokenizer = llm.get_tokenizer()
            lengths = [len(tokenizer.encode(t)) for t in TEXTS]
            assert lengths[0] == lengths[1] and len(set(lengths)) == 3
            outputs = llm.embed(TEXTS, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    for text, output in zip(TEXTS, outputs, strict=True):
        want = F.normalize(hf_hidden(model, tokenizer.encode(text)).mean(0), dim=-1)
        assert (torch.tensor(output.outputs.embedding) - want).abs().max().item() < TOLERANCE


def test_a_cross_encoder_on_the_triton_backend_scores_as_transformers(tmp_path):
    model = write_bert_classifier(tmp_path, num_labels=1)
    with triton_cpu_platform():
        llm = _llm(tmp_path)
        try:
            tokenizer = llm.get_tokenizer()
            outputs = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    for document, output in zip(TEXTS[1:], outputs, strict=True):
        with torch.no_grad():
            logit = model(**tokenizer(TEXTS[0], document, return_tensors="pt")).logits[0, 0]
        assert abs(output.outputs.score - logit.sigmoid().item()) < TOLERANCE
