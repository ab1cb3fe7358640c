"""BERT-family encoders (``BertModel``, as sentence-transformers ships them).

Absolute learned positions plus token-type embeddings, post-LayerNorm blocks, a GELU MLP
and bidirectional attention (``Attention(causal=False)``: the pooling runner feeds each
prompt whole, so every token sees every other). A single text is one segment (token type
0), as sentence-transformers encodes it. A text pair's second segment (a cross-encoder's
document) has token type 1, which reaches the model inside the token ids: an engine-core
request carries ``id + type * vocab_size`` (``encode_token_types``; the user-facing
prompt ids stay plain), so the types need no field of their own in the step protocol and
survive CUDA graphs.

``BertForSequenceClassification`` adds transformers' head on the CLS token: the pooler's
``tanh(dense(x))``, then ``classifier`` to one logit per label.

Layout: ``input_ids``/``positions`` [num_tokens] of the flattened batch, activations
[num_tokens, hidden_size]. Parameter names follow HF's except the merged ``qkv_proj``,
filled from ``attention.self.{query,key,value}``; files saved from a task model (with a
``bert.`` prefix) load too, and the unused ``pooler`` and task heads are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.config import ArchConfig, position_offset
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.gelu import get_gelu
from pagedlm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import get_weight_loader

_QKV = {"query": "q", "key": "k", "value": "v"}
_SKIPPED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


def _eps(arch: ArchConfig) -> float:
    return float(arch.raw.get("layer_norm_eps", 1e-12))


class BertEmbeddings(nn.Module):
    """ids, positions [T] -> LayerNorm(word + position + token type) [T, hidden]; RoBERTa
    reads its position table ``position_offset`` rows further (``config.position_offset``)."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.position_offset = position_offset(arch.architecture, arch.raw)
        self.word_embeddings = VocabParallelEmbedding(arch.vocab_size, hidden)
        self.position_embeddings = VocabParallelEmbedding(
            arch.max_position_embeddings + self.position_offset, hidden
        )
        self.token_type_embeddings = VocabParallelEmbedding(
            int(arch.raw.get("type_vocab_size", 2)), hidden
        )
        self.LayerNorm = nn.LayerNorm(hidden, eps=_eps(arch))

        self.vocab_size = arch.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = torch.div(input_ids, self.vocab_size, rounding_mode="floor")
        ids = input_ids - token_types * self.vocab_size
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


def encode_token_types(token_ids: list[int], token_types: list[int], vocab_size: int) -> list[int]:
    """A text pair's ids as ``BertEmbeddings`` reads them: each id plus its token type
    times the vocabulary size (see the module's doc)."""
    return [t + kind * vocab_size for t, kind in zip(token_ids, token_types, strict=True)]


class BertAttention(nn.Module):
    """x [T, hidden] -> LayerNorm(x + dense(attention(q, k, v))), bidirectional."""

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, heads, head_dim = arch.hidden_size, arch.num_attention_heads, arch.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.attn = Attention(
            layer_idx,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
            causal=False,
        )
        self.dense = RowParallelLinear(heads * head_dim, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=_eps(arch))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.LayerNorm(x + self.dense(self.attn(q, k, v, ctx)))


class BertLayer(nn.Module):
    """x [T, hidden] -> LayerNorm(h + down(gelu(up(h)))), h = attention(x)."""

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention = BertAttention(arch, layer_idx)
        self.intermediate = ColumnParallelLinear(
            arch.hidden_size, arch.intermediate_size, bias=True
        )
        self.act = get_gelu(arch.hidden_act or "gelu")
        self.output = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=True)
        self.output_norm = nn.LayerNorm(arch.hidden_size, eps=_eps(arch))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.attention(x, ctx)
        return self.output_norm(h + self.output(self.act(self.intermediate(h))))


class BertModel(nn.Module):
    """The model runner's entry point for ``BertModel`` checkpoints: input_ids, positions
    [T] -> the last layer's hidden states [T, hidden] (what the poolers read)."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        kind = arch.raw.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(
                f"BertModel with position_embedding_type={kind!r} is not supported; pagedlm "
                "runs absolute position embeddings."
            )
        self.arch = arch
        self.embeddings = BertEmbeddings(arch)
        self.layers = nn.ModuleList(BertLayer(arch, i) for i in range(arch.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: object = None,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, ctx)
        return x

    checkpoint_prefix = "bert."
    """What a task model's checkpoint puts before the encoder's tensor names."""
    skipped_prefixes = _SKIPPED_PREFIXES
    """Tensor names (after ``checkpoint_prefix``) that this class does not read: a task
    model's pooler and heads."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix(self.checkpoint_prefix)
            if name.startswith(self.skipped_prefixes):
                continue
            if name.startswith("pooler.dense."):
                name = name.replace("pooler.dense.", "pooler_dense.")
            name = name.replace("encoder.layer.", "layers.")
            name = name.replace(".attention.output.dense.", ".attention.dense.")
            name = name.replace(".attention.output.LayerNorm.", ".attention.LayerNorm.")
            name = name.replace(".intermediate.dense.", ".intermediate.")
            name = name.replace(".output.dense.", ".output.")
            name = name.replace(".output.LayerNorm.", ".output_norm.")
            shard_id = None
            for part, shard in _QKV.items():
                if f".attention.self.{part}." in name:
                    name = name.replace(f".attention.self.{part}.", ".attention.qkv_proj.")
                    shard_id = shard
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__}; "
                    "the file does not match a BERT architecture."
                )
            param = params[name]
            if shard_id is not None:
                param.weight_loader(param, tensor, shard_id)
            else:
                get_weight_loader(param)(param, tensor)
            loaded.add(name)
        return loaded


class BertForSequenceClassification(BertModel):
    """``BertForSequenceClassification`` checkpoints (cross-encoders such as
    ms-marco-MiniLM): ``BertModel``'s hidden states, and ``classifier_logits`` for the
    pooled CLS rows [N, hidden] -> [N, num_labels]."""

    skipped_prefixes = ("cls.", "embeddings.position_ids")

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__(arch, max_model_len)
        from pagedlm.pooling.model_config import classifier_config

        num_labels = classifier_config(arch).num_labels
        assert num_labels is not None
        self.pooler_dense = nn.Linear(arch.hidden_size, arch.hidden_size)
        self.classifier = nn.Linear(arch.hidden_size, num_labels)

    def classifier_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))

    def token_classifier_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every token's logits for ``token_classify``: the classifier alone, as vLLM's
        (BERT's pooler layer reads the CLS row only)."""
        return self.classifier(hidden)


class RobertaModel(BertModel):
    """``RobertaModel`` checkpoints (and, as ``XLMRobertaModel``, bge-m3 and multilingual-e5):
    BERT's blocks, positions from ``pad_token_id + 1``, one token type."""

    checkpoint_prefix = "roberta."


class RobertaForSequenceClassification(RobertaModel):
    """``RobertaForSequenceClassification`` checkpoints (and, under the XLM name,
    bge-reranker-v2-m3): transformers' head on the ``<s>`` row,
    ``out_proj(tanh(dense(x)))`` (no BERT pooler)."""

    skipped_prefixes = ("embeddings.position_ids",)

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__(arch, max_model_len)
        from pagedlm.pooling.model_config import classifier_config

        num_labels = classifier_config(arch).num_labels
        assert num_labels is not None
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(arch.hidden_size, arch.hidden_size)
        self.classifier.out_proj = nn.Linear(arch.hidden_size, num_labels)

    def classifier_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(pooled)))


class XLMRobertaModel(RobertaModel):
    """``XLMRobertaModel`` checkpoints: RoBERTa's layout under its own name."""


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """``XLMRobertaForSequenceClassification`` checkpoints: RoBERTa's layout."""
