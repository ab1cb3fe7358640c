"""The pooling runner on the GPU: a decoder embedding model (causal, last-token pooling)
matches transformers' float32 vectors, and a BERT encoder is refused by the triton backend
(it has no bidirectional attention) with an error naming what to do. Run with ``-m cuda``."""

from __future__ import annotations

import pytest
import torch

from embedding_checkpoints import hf_hidden, reference_vector, write_bert, write_decoder
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


def test_bert_is_refused_by_a_backend_without_bidirectional_attention(tmp_path):
    write_bert(tmp_path, "cls")
    with pytest.raises(ValueError, match=r"causal=False.*'triton'"):
        LLM(str(tmp_path), num_kv_blocks=64)
