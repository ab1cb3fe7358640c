"""Which runner a checkpoint gets, and how its prompts are pooled (``PoolerConfig``).

``runner="auto"`` (vLLM's default) serves embedding checkpoints as pooling models: an
encoder or a decoder without LM head (``POOLING_ARCHITECTURES``), or any directory that
sentence-transformers saved (``modules.json``). Everything else generates.

The pooling of a sentence-transformers directory comes from its modules: the ``Pooling``
module's config (CLS, mean or last token) and whether a ``Normalize`` module follows.
Without one, vLLM's defaults apply: CLS for BERT-family encoders, the last token for
decoders, L2-normalized either way.

Sequence classifiers (``*ForSequenceClassification``) are pooling models too: the same
pooling, then the checkpoint's head gives one logit per label (``id2label``). What turns
the logits into outputs follows sentence-transformers' ``CrossEncoder`` where its config
says (``activation_fn``), else transformers' ``problem_type``: identity for regression,
sigmoid for multi-label or a single label, softmax otherwise (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pagedlm.config import POOLING_TYPES, ROBERTA_ARCHITECTURES, RUNNERS, ArchConfig, PoolerConfig

POOLING_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "RobertaModel",
        "XLMRobertaModel",
        "LlamaModel",
        "MistralModel",
        "Qwen2Model",
        "Qwen3Model",
    }
)
"""Architectures that only embed (no LM head): "auto" runs them as pooling models."""
CLASSIFIER_ARCHITECTURES = frozenset(
    {
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "LlamaForSequenceClassification",
        "MistralForSequenceClassification",
        "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification",
    }
)
"""Architectures with a classification head instead of an LM head: pooling models that
give one logit per label (``LLM.classify``, ``LLM.score``, /classify, /score, /rerank)."""
ENCODER_ARCHITECTURES = frozenset(
    {"BertModel", "BertForSequenceClassification"} | ROBERTA_ARCHITECTURES
)
"""Bidirectional encoders: their default pooling is CLS, and they cannot generate."""
_ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax"}

_ST_MODULES = "sentence_transformers.models."
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def _modules(model_path: str) -> list[dict[str, Any]] | None:
    """sentence-transformers' ``modules.json`` of ``model_path`` (None: not such a directory)."""
    path = Path(model_path) / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{path} is not a list of modules; it is not sentence-transformers'.")
    return modules


def resolve_runner(requested: str, arch: ArchConfig, model_path: str) -> str:
    """ "generate" or "pooling" for ``runner=requested``; errors name the fix."""
    if requested not in RUNNERS:
        raise ValueError(f"runner={requested!r} is unknown; use one of {list(RUNNERS)}.")
    embeds = arch.architecture in POOLING_ARCHITECTURES | CLASSIFIER_ARCHITECTURES
    if requested == "auto":
        is_st = not model_path.endswith(".gguf") and _modules(model_path) is not None
        return "pooling" if embeds or is_st else "generate"
    if requested == "generate" and embeds:
        raise ValueError(
            f"{arch.architecture} has no LM head, so it cannot generate; serve it with "
            "runner='pooling' (--runner pooling) or runner='auto'."
        )
    return requested


def pooler_config(arch: ArchConfig, model_path: str) -> PoolerConfig:
    """How a pooling model pools: from its sentence-transformers modules, else defaults."""
    if arch.architecture in CLASSIFIER_ARCHITECTURES:
        return classifier_config(arch)
    matryoshka = arch.raw.get("matryoshka_dimensions")
    is_matryoshka = bool(arch.raw.get("is_matryoshka")) or bool(matryoshka)
    dimensions = tuple(int(d) for d in matryoshka) if matryoshka else None
    modules = None if model_path.endswith(".gguf") else _modules(model_path)
    if modules is None:
        default = "CLS" if arch.architecture in ENCODER_ARCHITECTURES else "LAST"
        return PoolerConfig(default, True, is_matryoshka, dimensions)
    pooling_type, normalize = _from_modules(modules, Path(model_path))
    return PoolerConfig(pooling_type, normalize, is_matryoshka, dimensions)


def _from_modules(modules: list[dict[str, Any]], root: Path) -> tuple[str, bool]:
    pooling_type = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_MODULES)
        if kind == "Transformer":
            if module.get("path", "") not in ("", "."):
                raise ValueError(
                    f"the Transformer module of {root} lives in {module['path']!r}; pass that "
                    "sub-directory as the model."
                )
        elif kind == "Pooling":
            pooling_type = _pooling_type(root / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"sentence-transformers module {module.get('type')!r} of {root} is not "
                "supported; pagedlm runs Transformer, Pooling and Normalize modules."
            )
    if pooling_type is None:
        raise ValueError(f"{root}/modules.json has no Pooling module; add one or remove the file.")
    return pooling_type, normalize


def _pooling_type(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"the sentence-transformers Pooling module has no {path}.")
    config = json.loads(path.read_text())
    unsupported = [mode for mode in _ST_UNSUPPORTED_MODES if config.get(mode)]
    chosen = [kind for key, kind in _ST_POOLING_MODES.items() if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path} asks for pooling {unsupported + chosen or 'none'}; pagedlm supports "
            "exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens and "
            "pooling_mode_lasttoken."
        )
    if config.get("include_prompt") is False:
        raise ValueError(f"{path} sets include_prompt=false, which pagedlm does not support.")
    return chosen[0]


def classifier_config(arch: ArchConfig) -> PoolerConfig:
    """A sequence classifier's pooling: CLS for encoders, the last token for decoders (as
    transformers' heads read them), never normalized; its labels and activation."""
    raw = arch.raw
    from_tokens = raw.get("classifier_from_token")
    pooling = "CLS" if arch.architecture in ENCODER_ARCHITECTURES else "LAST"
    if from_tokens:
        # A causal LM read as a classifier (vLLM's hf_overrides): two tokens give one logit,
        # the second's minus the first's (Qwen3-Reranker's "no", "yes"), under a sigmoid.
        if len(from_tokens) == 2:
            return PoolerConfig(pooling, False, labels=(str(from_tokens[1]),), activation="sigmoid")
        labels = tuple(str(token) for token in from_tokens)
        return PoolerConfig(pooling, False, labels=labels, activation="softmax")
    id2label = raw.get("id2label")
    if id2label:
        labels = tuple(str(id2label[key]) for key in sorted(id2label, key=int))
    else:  # transformers' default: two labels
        count = int(raw.get("num_labels", 2))
        labels = tuple(f"LABEL_{i}" for i in range(count))
    return PoolerConfig(pooling, False, labels=labels, activation=_activation(raw, len(labels)))


def with_classifier_token_ids(arch: ArchConfig, tokenizer: Any) -> ArchConfig:
    """``arch`` with the ids of its ``classifier_from_token`` words
    (``classifier_from_token_ids``), which the model reads its head from; each word must
    be one token of ``tokenizer``."""
    tokens = arch.raw.get("classifier_from_token")
    if not tokens:
        return arch
    if (
        arch.architecture in ENCODER_ARCHITECTURES
        or arch.architecture not in CLASSIFIER_ARCHITECTURES
    ):
        raise ValueError(
            "classifier_from_token reads a classifier from a causal LM's head; set "
            'hf_overrides {"architectures": ["Qwen3ForSequenceClassification"], ...} (or the '
            "Llama, Mistral or Qwen2 one) for a decoder checkpoint."
        )
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer; do not skip it.")
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(str(token), add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"classifier_from_token word {token!r} is {len(encoded)} tokens of this "
                "tokenizer; each must be exactly one."
            )
        ids.append(int(encoded[0]))
    return dataclasses.replace(arch, raw={**arch.raw, "classifier_from_token_ids": ids})


def _activation(raw: dict[str, Any], num_labels: int) -> str:
    st_config = raw.get("sentence_transformers")
    name = (st_config or {}).get("activation_fn") or raw.get("sbert_ce_default_activation_function")
    if name:
        activation = _ST_ACTIVATIONS.get(str(name).rsplit(".", 1)[-1])
        if activation is None:
            raise ValueError(
                f"config.json asks for the cross-encoder activation {name!r}; pagedlm "
                f"supports {sorted(_ST_ACTIVATIONS)} (torch.nn.modules.*)."
            )
        return activation
    problem = raw.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def reads_token_types(arch: ArchConfig) -> bool:
    """Whether the model tells a pair's two segments apart by token type (BERT with more
    than one type), so that a pair's engine-core ids carry them."""
    return (
        arch.architecture in ENCODER_ARCHITECTURES and int(arch.raw.get("type_vocab_size", 2)) > 1
    )


def caches_prefixes(arch: ArchConfig, pooler: PoolerConfig) -> bool:
    """Whether a pooling model may take a prompt's prefix from the prefix cache: causal
    attention (a token's keys do not depend on later tokens) and last-token pooling (the
    pooler reads only the last row, which is always computed). Encoders and MEAN/CLS
    pooling need every row of the prompt in the step."""
    return pooler.pooling_type == "LAST" and arch.architecture not in ENCODER_ARCHITECTURES


POOLER_CONFIG_KEYS = ("pooling_type", "seq_pooling_type", "normalize", "use_activation")
"""The keys of vLLM's ``--pooler-config`` that pagedlm applies."""
_UNSUPPORTED_POOLER_KEYS = {
    "tok_pooling_type": "token-wise pooling (ALL, STEP) is not served",
    "dimensions": "pass dimensions per request (matryoshka models)",
    "enable_chunked_processing": "prompts longer than the model's context are refused",
    "max_embed_len": "prompts longer than the model's context are refused",
    "logit_bias": "classifier logits are not shifted",
    "step_tag_id": "step pooling is not served",
    "returned_token_ids": "step pooling is not served",
}


def with_pooler_overrides(config: PoolerConfig, overrides: dict[str, Any] | None) -> PoolerConfig:
    """``config`` with vLLM's ``--pooler-config`` keys applied over what the checkpoint
    says: ``pooling_type`` (or ``seq_pooling_type``), ``normalize`` (embeddings) and
    ``use_activation`` (a classifier's activation; false: its raw logits)."""
    if not overrides:
        return config
    for key in overrides:
        if key in _UNSUPPORTED_POOLER_KEYS:
            raise ValueError(
                f"pooler_config.{key} is not supported ({_UNSUPPORTED_POOLER_KEYS[key]}); drop it."
            )
        if key not in POOLER_CONFIG_KEYS:
            raise ValueError(
                f"pooler_config has an unknown key {key!r}; use {list(POOLER_CONFIG_KEYS)}."
            )
    changes: dict[str, Any] = {}
    both = {overrides.get("pooling_type"), overrides.get("seq_pooling_type")} - {None}
    if len(both) > 1:
        raise ValueError(
            "pooler_config gives pooling_type and seq_pooling_type different values; pass one."
        )
    if both:
        pooling_type = str(both.pop()).upper()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type={pooling_type!r} is not served; use one of "
                f"{list(POOLING_TYPES)}."
            )
        changes["pooling_type"] = pooling_type
    for key in ("normalize", "use_activation"):
        if key in overrides and not isinstance(overrides[key], bool):
            raise ValueError(f"pooler_config.{key} must be true or false, got {overrides[key]!r}.")
    if "normalize" in overrides:
        if config.labels is not None:
            raise ValueError(
                "pooler_config.normalize applies to embedding models; this checkpoint is a "
                "classifier (use use_activation)."
            )
        changes["normalize"] = overrides["normalize"]
    if "use_activation" in overrides:
        if config.labels is None:
            raise ValueError(
                "pooler_config.use_activation applies to classifiers; this checkpoint embeds "
                "(use normalize)."
            )
        if not overrides["use_activation"]:
            changes["activation"] = "identity"
    return dataclasses.replace(config, **changes)
