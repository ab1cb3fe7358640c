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

Token classifiers (``*ForTokenClassification``) and reward models (``Qwen2ForRewardModel``,
``Qwen2ForProcessRewardModel``) read their head at every token: they pool token-wise only
(``sequence_pooling=False``), every token ("ALL") or, for a process reward model, the
positions of a step tag ("STEP", vLLM's defaults). Every pooling model also serves the
token-wise task of its kind (``pagedlm.pooling.tasks``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pagedlm.config import (
    POOLING_TYPES,
    ROBERTA_ARCHITECTURES,
    RUNNERS,
    TOKEN_POOLING_TYPES,
    ArchConfig,
    PoolerConfig,
)

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
TOKEN_CLASSIFIER_ARCHITECTURES = frozenset(
    {
        "LlamaForTokenClassification",
        "MistralForTokenClassification",
        "Qwen2ForTokenClassification",
        "Qwen3ForTokenClassification",
        "Qwen2ForRewardModel",
        "Qwen2ForProcessRewardModel",
    }
)
"""Architectures whose head gives logits at every token: pooling models serving
``token_classify`` only (``LLM.reward``, ``LLM.encode(pooling_task="token_classify")``)."""
_REWARD_LABELS = {"Qwen2ForRewardModel": 1, "Qwen2ForProcessRewardModel": 2}
"""Reward models' heads have a fixed width whatever their config says (vLLM's)."""
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
    embeds = arch.architecture in (
        POOLING_ARCHITECTURES | CLASSIFIER_ARCHITECTURES | TOKEN_CLASSIFIER_ARCHITECTURES
    )
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
    if arch.architecture in TOKEN_CLASSIFIER_ARCHITECTURES:
        return token_classifier_config(arch)
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


def token_classifier_config(arch: ArchConfig) -> PoolerConfig:
    """A token classifier's or reward model's pooling: its head at every token (STEP for a
    process reward model), its labels and activation as a sequence classifier's."""
    raw = arch.raw
    count = _REWARD_LABELS.get(arch.architecture)
    id2label = raw.get("id2label")
    if id2label and (count is None or len(id2label) == count):
        labels = tuple(str(id2label[key]) for key in sorted(id2label, key=int))
    else:
        count = count or int(raw.get("num_labels", 2))
        labels = tuple(f"LABEL_{i}" for i in range(count))
    step = arch.architecture == "Qwen2ForProcessRewardModel"
    return PoolerConfig(
        "LAST",
        False,
        labels=labels,
        activation=_activation(raw, len(labels)),
        sequence_pooling=False,
        tok_pooling_type="STEP" if step else "ALL",
    )


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
    pooler reads only the last row, which is always computed). Encoders, MEAN/CLS pooling
    and models that pool token-wise only need every row of the prompt (vLLM turns the
    cache off for ALL pooling); a token-wise request to a model that caches reads nothing
    from the cache (``PoolingSpec``)."""
    return (
        pooler.sequence_pooling
        and pooler.pooling_type == "LAST"
        and arch.architecture not in ENCODER_ARCHITECTURES
    )


def chunks_prompts(arch: ArchConfig, pooler: PoolerConfig, budget: int | None) -> bool:
    """Whether the pooling runner may compute a prompt over several steps: causal
    attention, and a pooler that needs no more than the step's rows (the last token's, or
    token-wise rows gathered chunk by chunk on the worker). Only when the step budget
    (``max_num_batched_tokens``) is set: by default the pooling runner's budget holds
    ``max_model_len`` tokens and every prompt runs whole."""
    if budget is None or arch.architecture in ENCODER_ARCHITECTURES:
        return False
    return not pooler.sequence_pooling or pooler.pooling_type == "LAST"


POOLER_CONFIG_KEYS = (
    "pooling_type",
    "seq_pooling_type",
    "tok_pooling_type",
    "normalize",
    "use_activation",
    "step_tag_id",
    "returned_token_ids",
)
"""The keys of vLLM's ``--pooler-config`` that pagedlm applies."""
_UNSUPPORTED_POOLER_KEYS = {
    "dimensions": "pass dimensions per request (matryoshka models)",
    "enable_chunked_processing": "prompts longer than the model's context are refused",
    "max_embed_len": "prompts longer than the model's context are refused",
    "logit_bias": "classifier logits are not shifted",
}


def with_pooler_overrides(
    config: PoolerConfig, overrides: dict[str, Any] | None, hidden_size: int | None = None
) -> PoolerConfig:
    """``config`` with vLLM's ``--pooler-config`` keys applied over what the checkpoint
    says: ``pooling_type`` (a sequence pooling, or "ALL"/"STEP" for the token-wise tasks,
    as vLLM reads it), ``seq_pooling_type``, ``tok_pooling_type``, ``normalize``
    (embeddings), ``use_activation`` (a classifier's activation; false: its raw logits),
    and STEP pooling's ``step_tag_id`` and ``returned_token_ids``."""
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
    changes: dict[str, Any] = _pooling_types(overrides)
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
    changes.update(_step_fields(overrides))
    result = dataclasses.replace(config, **changes)
    step_keys = [key for key in ("step_tag_id", "returned_token_ids") if key in changes]
    if step_keys and result.tok_pooling_type != "STEP":
        raise ValueError(
            f"pooler_config.{step_keys[0]} applies to STEP pooling, and this model pools "
            f'token-wise with {result.tok_pooling_type!r}; add "tok_pooling_type": "STEP".'
        )
    columns = result.returned_token_ids
    if columns and result.labels is not None and max(columns) >= len(result.labels):
        raise ValueError(
            f"pooler_config.returned_token_ids {list(columns)} name columns the head has not: "
            f"it gives {len(result.labels)} labels."
        )
    if columns and result.labels is None and hidden_size and max(columns) >= hidden_size:
        raise ValueError(
            f"pooler_config.returned_token_ids {list(columns)} name columns the embeddings "
            f"have not: they have {hidden_size} dimensions."
        )
    return result


def _pooling_types(overrides: dict[str, Any]) -> dict[str, str]:
    """``pooling_type`` sorted into the sequence or token-wise kind it names, checked
    against ``seq_pooling_type`` and ``tok_pooling_type``."""
    given = {key: str(overrides[key]).upper() for key in POOLER_CONFIG_KEYS[:3] if key in overrides}
    kinds = {"seq_pooling_type": POOLING_TYPES, "tok_pooling_type": TOKEN_POOLING_TYPES}
    chosen: dict[str, str] = {}
    for key, value in given.items():
        kind = key
        if key == "pooling_type":
            kind = "tok_pooling_type" if value in TOKEN_POOLING_TYPES else "seq_pooling_type"
        if value not in kinds[kind]:
            allowed = (
                list(POOLING_TYPES + TOKEN_POOLING_TYPES)
                if key == "pooling_type"
                else list(kinds[kind])
            )
            raise ValueError(f"pooler_config.{key}={value!r} is not served; use one of {allowed}.")
        if chosen.get(kind, value) != value:
            raise ValueError(
                f"pooler_config gives pooling_type and {kind} different values; pass one."
            )
        chosen[kind] = value
    changes = {}
    if "seq_pooling_type" in chosen:
        changes["pooling_type"] = chosen["seq_pooling_type"]
    if "tok_pooling_type" in chosen:
        changes["tok_pooling_type"] = chosen["tok_pooling_type"]
    return changes


def _step_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    step_tag_id = overrides.get("step_tag_id")
    if step_tag_id is not None:
        if isinstance(step_tag_id, bool) or not isinstance(step_tag_id, int) or step_tag_id < 0:
            raise ValueError(
                f"pooler_config.step_tag_id must be a token id (an integer >= 0), got "
                f"{step_tag_id!r}."
            )
        changes["step_tag_id"] = step_tag_id
    columns = overrides.get("returned_token_ids")
    if columns is not None:
        if not isinstance(columns, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in columns
        ):
            raise ValueError(
                f"pooler_config.returned_token_ids must be a list of column indices, got "
                f"{columns!r}."
            )
        changes["returned_token_ids"] = tuple(columns)
    return changes
