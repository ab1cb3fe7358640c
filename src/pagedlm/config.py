"""Engine configuration: frozen dataclasses, validated once at the edge.

``EngineConfig.create(...)`` is the single place user-facing arguments become a
configuration; every error it raises names the argument to change.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"Unknown dtype {name!r}; use 'auto', 'float32', 'bfloat16' or 'float16'."
        ) from None


# GPT-2-era config keys -> the names every later config uses (transformers' attribute_map).
_GPT2_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
    "n_inner": "intermediate_size",
    "activation_function": "hidden_act",
}


def _with_standard_names(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with GPT-2-style keys also given their standard names (originals kept).

    In such a file the GPT-2 keys are the ones transformers reads, so they win over any
    stray standard-named key; GPT-2 has no grouped-query attention.
    """
    if "n_embd" not in cfg:
        return cfg
    out = dict(cfg)
    for old, new in _GPT2_NAMES.items():
        if out.get(old) is not None:
            out[new] = out[old]
    if out.get("n_inner") is None:
        out["intermediate_size"] = 4 * out["hidden_size"]  # GPT-2's n_inner=None default
    out["num_key_value_heads"] = out["num_attention_heads"]
    out.pop("head_dim", None)
    return out


_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def _with_transformers_names(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the standard keys it lacks read from transformers' config class of its
    ``model_type``, which maps a model's own spellings (``attribute_map``) and knows its
    defaults: architectures pagedlm does not implement (the Transformers backend) may name
    them otherwise. Unchanged when nothing is missing or transformers has no such class."""
    missing = [key for key in _REQUIRED_KEYS if key not in cfg]
    if not missing or not cfg.get("model_type"):
        return cfg
    from transformers import AutoConfig

    try:
        fields = {key: value for key, value in cfg.items() if key != "model_type"}
        config = AutoConfig.for_model(cfg["model_type"], **fields)
    except ValueError:  # a model_type transformers does not know
        return cfg
    out = dict(cfg)
    for key in (*missing, "num_key_value_heads", "head_dim"):
        value = getattr(config, key, None)
        if key not in out and value is not None:
            out[key] = value
    out.setdefault("intermediate_size", 0)  # read by pagedlm's own MLPs only
    return out


def _with_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config (LLaVA, Qwen2.5-VL, Gemma 3) describes its decoder in
    ``text_config``: those keys win, the top level (``architectures``, ``vision_config``,
    the image token id) stays beside them."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    return {**cfg, **{k: v for k, v in text.items() if k != "architectures"}}


def _complete_yarn(rope_scaling: dict[str, Any], cfg: dict[str, Any]) -> None:
    """YaRN's pretraining length as transformers reads it (a top-level
    ``original_max_position_embeddings`` first, then the rope dict's, then
    ``max_position_embeddings``), and its factor from the two lengths where not given."""
    original = (
        cfg.get("original_max_position_embeddings")
        or rope_scaling.get("original_max_position_embeddings")
        or cfg.get("max_position_embeddings", 2048)
    )
    rope_scaling["original_max_position_embeddings"] = int(original)
    if rope_scaling.get("factor") is None:
        rope_scaling["factor"] = cfg.get("max_position_embeddings", 2048) / original


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only transformer, independent of how the file spelled it.

    Built from a HF ``config.json`` dict (both the transformers-5 spelling with
    ``rope_parameters``/``dtype`` and the older ``rope_theta``/``torch_dtype``) or from
    GGUF metadata. ``raw`` keeps the original dict for architecture-specific extras.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        cfg = _with_transformers_names(_with_standard_names(_with_text_config(cfg)))
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(
                "config.json has no 'architectures' entry; add e.g. "
                '"architectures": ["LlamaForCausalLM"].'
            )
        # transformers 5 nests rope settings in rope_parameters; older files use rope_theta
        # plus an optional rope_scaling dict.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = rope_params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        if rope_params:
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rope_type != "default":
                rope_scaling = rope_params
        if rope_params.get("mrope_section") and rope_scaling is None:
            rope_scaling = rope_params  # transformers 5 writes M-RoPE as type "default"
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling.get("mrope_section"):
                # Qwen2-VL's three-part positions (older files say type "mrope" or "default")
                rope_scaling["rope_type"] = "mrope"
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
            elif rope_scaling["rope_type"] == "yarn":
                _complete_yarn(rope_scaling, cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if cfg.get("kv_lora_rank") and cfg.get("qk_nope_head_dim") is not None:
            # Multi-head latent attention run as multi-head attention (DeepSeek): the
            # cached keys have the no-rope and rope features of each head.
            head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        arch = archs[0]
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048)
            - position_offset(arch, cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=sliding,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> ArchConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"{path} has no config.json; pass a Hugging Face model directory "
                "(config.json + *.safetensors) or a .gguf file."
            )
        raw = json.loads(config_file.read_text())
        modelopt_file = Path(path) / "hf_quant_config.json"
        if "quantization_config" not in raw and modelopt_file.is_file():
            # NVIDIA ModelOpt writes its quantization beside config.json.
            quantization = json.loads(modelopt_file.read_text()).get("quantization") or {}
            raw["quantization_config"] = {"quant_method": "modelopt", **quantization}
        return cls.from_hf_dict(raw)

    @property
    def eos_token_ids(self) -> set[int]:
        if self.eos_token_id is None:
            return set()
        if isinstance(self.eos_token_id, int):
            return {self.eos_token_id}
        return set(self.eos_token_id)


ROBERTA_ARCHITECTURES = frozenset(
    {
        "RobertaModel",
        "XLMRobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    }
)
"""BERT-family encoders whose positions start after the padding id (``pad_token_id + 1``)."""


def position_offset(architecture: str, cfg: dict[str, Any]) -> int:
    """The first position id a model's position table is read at: ``pad_token_id + 1``
    for RoBERTa, whose table has that many rows more than the tokens it takes (514 for
    512); 0 otherwise. ``ArchConfig.max_position_embeddings`` counts tokens."""
    if architecture not in ROBERTA_ARCHITECTURES:
        return 0
    return int(cfg.get("pad_token_id", 1)) + 1


POOLING_TYPES = ("LAST", "MEAN", "CLS")
TOKEN_POOLING_TYPES = ("ALL", "STEP")
"""Token-wise pooling (vLLM's ``tok_pooling_type``): every prompt token's row, or only the
rows of the positions holding ``step_tag_id`` (process reward models)."""
CLASSIFIER_ACTIVATIONS = ("softmax", "sigmoid", "identity")
RUNNERS = ("auto", "generate", "pooling")
"""``runner`` values (vLLM's); "auto" resolves to one of the other two at the edge."""
MODEL_IMPLS = ("auto", "vllm", "transformers")
"""``model_impl`` values (vLLM's): "vllm" pagedlm's own model classes, "transformers" the
Transformers modeling backend, "auto" the first where there is one; resolved at the edge
(``pagedlm.engine.model_impl_args``) to "vllm" or "transformers"."""
MODEL_IMPL_ALIASES = {"pagedlm": "vllm"}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's final hidden states into one vector
    (``pagedlm.pooling``): from the sentence-transformers config when the checkpoint has
    one, else vLLM's default for a decoder (the last token's, L2-normalized)."""

    pooling_type: str = "LAST"
    """"LAST" (the last token's hidden state), "MEAN" (the average over the prompt) or
    "CLS" (the first token's)."""
    normalize: bool = True
    """L2-normalize the vector (a request's ``normalize`` may override it)."""
    is_matryoshka: bool = False
    """The model was trained so that a prefix of its vector is an embedding too, so a
    request's ``dimensions`` may cut it (config.json's ``is_matryoshka`` or
    ``matryoshka_dimensions``)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """The prefix lengths ``dimensions`` may take (None: any up to the hidden size)."""
    labels: tuple[str, ...] | None = None
    """A classifier's class names, one per logit (config.json's ``id2label``); None: the
    model embeds. A classifier's pooled vector goes through its head on the worker, and
    ``normalize``/``is_matryoshka`` do not apply to it."""
    activation: str = "identity"
    """What turns a classifier's logits into its outputs when a request does not turn it
    off (``PoolingParams.use_activation``): one of ``CLASSIFIER_ACTIVATIONS``."""
    sequence_pooling: bool = True
    """Whether the model also pools whole prompts (``pooling_type``: embed, classify,
    score) besides token-wise; False for models whose head reads every token
    (``*ForTokenClassification``, reward models), which serve ``token_classify`` only."""
    tok_pooling_type: str = "ALL"
    """Token-wise tasks (``token_embed``, ``token_classify``): one of
    ``TOKEN_POOLING_TYPES``."""
    step_tag_id: int | None = None
    """STEP pooling: keep the rows of the prompt positions holding this token id (None:
    every row); a request's ``step_tag_id`` overrides it."""
    returned_token_ids: tuple[int, ...] | None = None
    """STEP pooling: keep these columns (a reward head's labels) before the activation."""

    @property
    def num_labels(self) -> int | None:
        """A classifier's number of logits; None for an embedding model."""
        return None if self.labels is None else len(self.labels)


INT_CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
"""``ModelConfig.quantization`` values of checkpoints whose layers are integer codes."""


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Local HF directory or .gguf file (resolved; never None here)."""
    tokenizer: str | None
    arch: ArchConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    """"auto" (by file type: a .gguf file, or a directory's safetensors, else its PyTorch
    .bin/.pt files), "safetensors", "pt" (PyTorch files), "gguf", or "dummy" (random
    weights, no files); ``loader.weight_files`` says which files each reads."""
    revision: str | None = None
    """The hub revision ``model`` was resolved at (None: a local path or the default branch)."""
    tokenizer_mode: str = "auto"
    """vLLM's: "auto"/"hf" (a fast tokenizer where there is one) or "slow" (transformers'
    Python tokenizer)."""
    quantization: str | None = None
    """None, "bitsandbytes" (linear layers quantized at load, see ``bnb_quant_type``), "fp8"
    (E4M3 weights: quantized at load, or read from an FP8 checkpoint), or one of
    ``INT_CHECKPOINT_METHODS`` (a checkpoint of integer codes: ``quantization.int_formats``;
    "compressed-tensors" here means its integer format, its FP8 one being "fp8")."""
    bnb_quant_type: str = "nf4"
    """With bitsandbytes: "nf4" or "fp4" (4-bit, blocks of 64) or "int8" (per-row 8-bit)."""
    trust_remote_code: bool = False
    enable_sleep_mode: bool = False
    """``sleep``/``wake_up`` are allowed (vLLM's ``enable_sleep_mode``)."""
    enforce_eager: bool = False
    """Never replay decode steps from CUDA graphs (platforms without graphs are always eager)."""
    runner: str = "generate"
    """"generate" (sample tokens) or "pooling" (one vector per prompt, no decoding)."""
    pooler: PoolerConfig | None = None
    """With ``runner="pooling"``: how prompts are pooled."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """``SamplingParams`` fields a request that leaves them unset gets (from the model's
    generation config: ``pagedlm.generation_config``); empty for pagedlm's own defaults."""
    max_logprobs: int = 20
    """The most ``logprobs`` / ``prompt_logprobs`` a request may ask for (the vocabulary
    size where ``EngineArgs.max_logprobs`` is -1)."""
    logprobs_mode: str = "raw_logprobs"
    """What sampled tokens' logprobs report (``pagedlm.sample.logprobs.LOGPROBS_MODES``)."""
    model_impl: str = "vllm"
    """Which implementation runs ``arch``: "vllm" (pagedlm's own class) or "transformers"
    (the Transformers modeling backend); "auto" (the first of them that exists) when built
    outside ``EngineArgs``."""
    enable_prompt_embeds: bool = False
    """Prompts may be given as input embeddings ``[num_tokens, hidden_size]`` (vLLM's
    ``enable_prompt_embeds``; ``pagedlm.engine.prompt_embeds``)."""

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def has_weight_blocks(self) -> bool:
        """Whether the checkpoint's linear layers come as quantized blocks a platform's
        kernels can compute on (``Platform.computes_on_weight_blocks``): a GGUF file's, not
        requantized, or an integer checkpoint's (GPTQ, AWQ, compressed-tensors); never
        dummy weights."""
        if self.load_format == "dummy":
            return False
        if self.is_gguf:
            return self.quantization is None
        return self.quantization in INT_CHECKPOINT_METHODS


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    """None: the platform sizes the cache from its memory budget."""
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    """Memory budget for the KV cache when ``num_kv_blocks`` is None (platform default)."""
    gpu_memory_utilization: float = 0.9
    """Fraction in (0, 1] of the device's memory the engine may use in all (weights,
    activations, KV cache); read by GPU platforms when they size the KV cache."""
    cpu_offload_gb: float = 0
    """GiB of weights per device kept in pinned host memory and read in place
    (``pagedlm.model_executor.weight_offload``)."""
    cache_dtype: str = "auto"
    """vLLM's ``kv_cache_dtype``, canonical: "auto" (the model's dtype; also what
    "float16"/"bfloat16" become where they name it) or "fp8" (= "fp8_e4m3"):
    keys and values stored in float8 E4M3 with per-layer ``k_scale``/``v_scale``
    (``pagedlm.kv_cache.fp8``)."""
    calculate_kv_scales: bool = False
    """With an fp8 cache: each layer's scales from the first real step's keys and values,
    instead of the checkpoint's ``k_scale``/``v_scale`` tensors (or 1.0 without them)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    async_scheduling: bool = False
    """Schedule step N+1 while step N runs (one step in flight), so the host's per-step
    work overlaps the device's; resolved from the platform's default at the edge."""
    scheduling_policy: str = "fcfs"
    """"fcfs" (arrival order) or "priority" (lowest ``priority`` value first, then
    arrival; preemption takes the lowest-priority running request)."""
    long_prefill_token_threshold: int = 0
    """A prompt computes at most this many tokens per step (vLLM's flag), leaving the rest
    of the budget to other requests; 0: no cap beyond the budget."""
    stream_interval: int = 1
    """A running request's outputs go to the caller every this many new tokens (after its
    first ones; vLLM's flag): the front end's work per token, not the engine's."""
    whole_prompts: bool = False
    """A prompt is scheduled in one step or waits (the pooling runner: mean and CLS pooling
    and bidirectional attention need every token of the prompt in the same forward)."""
    max_num_encoder_input_tokens: int | None = None
    """Multimodal: embedding rows the vision encoder may produce per step (vLLM's name;
    None: ``max_num_batched_tokens``). An image larger than this is encoded alone."""
    encoder_cache_size: int | None = None
    """Multimodal: embedding rows kept in the workers' encoder cache beyond those running
    requests still need (None: the encoder budget)."""

    @property
    def chunked_prefill(self) -> bool:
        return self.max_num_batched_tokens < self.max_model_len


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "acceptance")
"""``speculative_config["method"]`` values; "acceptance" is the benchmarks' proposer."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``), built and validated from the
    user's dict by ``pagedlm.engine.speculative_args``.

    Every step a decoding request may verify up to ``num_speculative_tokens`` drafted
    tokens; the proposer (``method``) drafts them on the workers after each step's
    sampling. The never-hurts policy (``core/speculation.py``) stops proposing in steps
    with more than ``disable_by_batch_size`` running requests, and for a request whose
    running acceptance rate is below ``min_acceptance_rate``.
    """

    method: str
    num_speculative_tokens: int
    draft_model: ModelConfig | None = None
    """The draft model or EAGLE head ("draft_model", "eagle", "eagle3"), loaded like the
    target (same dtype and ``max_model_len``); None for "ngram", and for "mtp" while the
    workers read its layer from the target's own checkpoint (set, to the last checkpoint
    that held the layer, after a weight update from disk to one without it)."""
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    """"ngram": the shortest and longest suffix looked up in the request's tokens."""
    disable_by_batch_size: int | None = 32
    """No request proposes in a step with more running requests than this (None: never off)."""
    min_acceptance_rate: float = 0.25
    """A request stops proposing (but probes now and then) while the running mean of its
    drafts' acceptance rate is below this (0: always propose)."""
    acceptance_rate: float | None = None
    """"acceptance" (benchmarks only): the chance that each drafted token is right."""
    reference_path: str | None = None
    """"acceptance": a JSON file of ``[prompt_token_ids, greedy_continuation]`` pairs."""

    @property
    def proposer_writes_kv(self) -> bool:
        """The proposer keeps its own KV in the paged cache (so drafts need slots ahead)."""
        return self.method in ("draft_model", "eagle", "eagle3", "mtp")

    @property
    def proposer_kv_reads_next_token(self) -> bool:
        """The proposer's KV at position ``p`` is computed from the token at ``p + 1``
        (EAGLE and MTP heads take the next token's embedding with the target's hidden
        state at ``p``), so it is not a function of the tokens up to ``p`` alone."""
        return self.method in ("eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes and devices (vLLM's names).

    One engine core drives ``world_size = tensor_parallel_size * pipeline_parallel_size``
    workers, rank ``r`` on pipeline stage ``r // tensor_parallel_size``; with
    ``data_parallel_size > 1`` that many engine cores run side by side, each with its own
    scheduler, KV cache and workers, and this config belongs to replica
    ``data_parallel_rank``.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    enable_expert_parallel: bool = False
    """Shard MoE experts whole across the tensor-parallel ranks instead of slicing each."""
    distributed_executor_backend: str = "uni"
    """The executor: "uni" (one worker in the engine's process), "mp" (a process per
    rank), "ray" (Ray actors), or a plugin's name; resolved at the edge."""
    worker_extension_cls: str | None = None
    """An importable class whose methods are mixed into every worker, for
    ``collective_rpc`` (``pagedlm.worker.extension``); checked at the edge."""

    @property
    def world_size(self) -> int:
        """Workers of one engine core."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def first_local_device(self) -> int:
        """Index of this replica's first device on the node: replicas take consecutive
        runs of ``world_size`` devices."""
        return self.data_parallel_rank * self.world_size


def _json_fields(cls: type, name: str, value: object, example: str) -> dict[str, Any]:
    """The fields of config dataclass ``cls`` given as a dict or its JSON (the CLI's
    form) for the option ``name``; ValueError for invalid JSON, a non-object (showing
    ``example``) or keys ``cls`` lacks (listing those it has)."""
    import dataclasses
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, e.g. '{example}'.")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"Unknown {name} key(s) {unknown}; known: {sorted(known)}.")
    return value


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: publish the prefix cache's block events
    (``kv_cache/events.py``) on a ZMQ PUB socket, with a replay socket for missed ones."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null" (record nothing); None: "zmq" when events are enabled."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    """A ROUTER socket answering "everything from sequence number N" (None: no replay)."""
    buffer_steps: int = 10_000
    """How many recent batches the replay socket can still send."""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def parse(cls, value: object) -> KVEventsConfig:
        """From None, a dict, a JSON object string (the CLI's form) or an instance."""
        if value is None or isinstance(value, cls):
            return value or cls()
        example = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
        config = cls(**_json_fields(cls, "kv_events_config", value, example))
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(
                f'kv_events_config publisher must be "zmq" or "null", got {config.publisher!r}.'
            )
        return config


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
"""vLLM's ``KVRole``: an instance that saves KV, one that loads it, or both."""
KV_LOAD_FAILURE_POLICIES = ("recompute",)
"""What happens to blocks that fail to load: computed instead (vLLM's "recompute")."""


def _new_engine_id() -> str:
    import uuid

    return str(uuid.uuid4())


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` (``--kv-transfer-config``): a KV connector that moves
    prompts' keys and values between this engine and others (``pagedlm.kv_transfer``).

    vLLM's names and defaults for the fields kept; vLLM's fields for its network connectors
    (``kv_ip``, ``kv_port``, ``kv_rank``, ``kv_parallel_size``, ``kv_buffer_size``,
    ``enable_permute_local_kv``) are refused as unknown keys, since no connector here reads
    them."""

    kv_connector: str | None = None
    """The connector's registered name (``pagedlm.kv_transfer.factory``), or a class name
    in ``kv_connector_module_path``; None: no KV transfer."""
    kv_role: str | None = None
    """"kv_producer" (saves), "kv_consumer" (loads) or "kv_both"; required with a connector."""
    engine_id: str = field(default_factory=_new_engine_id)
    """This engine's identity in KV transfers (vLLM's default: a fresh uuid4)."""
    kv_buffer_device: str = "cuda"
    """Where a connector stages KV ("cuda", "cpu", "xpu"; vLLM's default "cuda"). The
    shared-storage connector stages through host memory whatever it says, as vLLM's does."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """The connector's own options (the shared-storage connector: ``shared_storage_path``)."""
    kv_connector_module_path: str | None = None
    """A module to import ``kv_connector`` from: a third-party connector class."""
    kv_load_failure_policy: str = "recompute"
    """Blocks that fail to load are computed instead. vLLM's default is "fail" (the request
    ends with an error); pagedlm has no error finish reason and takes only "recompute"."""

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(
                f"Unsupported kv_role: {self.kv_role!r}. Supported roles are {list(KV_ROLES)}."
            )
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(
                f"kv_transfer_config names kv_connector={self.kv_connector!r} but no kv_role; "
                f'add "kv_role": one of {list(KV_ROLES)}.'
            )
        if self.kv_connector is None and self.kv_connector_module_path is not None:
            raise ValueError(
                "kv_transfer_config has kv_connector_module_path but no kv_connector; name "
                "the connector class in that module as kv_connector."
            )
        if self.kv_buffer_device not in ("cuda", "cpu", "xpu"):
            raise ValueError(
                f"kv_buffer_device must be 'cuda', 'cpu' or 'xpu', got {self.kv_buffer_device!r}."
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_connector_extra_config must be a JSON object, got "
                f"{self.kv_connector_extra_config!r}."
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy={self.kv_load_failure_policy!r} is not supported: "
                'pagedlm computes the blocks that fail to load ("recompute") and has no '
                'error finish reason for vLLM\'s "fail"; drop the key or pass "recompute".'
            )

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def parse(cls, value: object) -> KVTransferConfig | None:
        """From None, a dict, a JSON object string (the CLI's form) or an instance; None
        when no connector is named (KV transfer off)."""
        if value is None or isinstance(value, cls):
            return value if value is None or value.kv_connector is not None else None
        example = (
            '{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
        )
        config = cls(**_json_fields(cls, "kv_transfer_config", value, example))
        return config if config.kv_connector is not None else None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names and defaults); present only with ``enable_lora``."""

    max_loras: int = 1
    """Adapters one step may use (device slots): the scheduler admits no more."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; device slots are this wide."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory after leaving a device slot (None: ``max_loras``)."""

    def __post_init__(self) -> None:
        validate_positive("max_loras", self.max_loras, allow_none=False)
        validate_positive("max_lora_rank", self.max_lora_rank, allow_none=False)
        validate_positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                f"({self.max_loras}); raise --max-cpu-loras or lower --max-loras."
            )

    @property
    def host_cache_size(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class MultiModalConfig:
    """What a prompt may carry besides text (vision-language models), checked at the front
    end: images per prompt, where images may come from, and the limits of fetching them."""

    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 999})
    """Most items of each modality in one prompt (vLLM's ``limit_mm_per_prompt``)."""
    allowed_local_media_path: str | None = None
    """A directory whose files ``file://`` image URLs may name (None: no local files)."""
    media_fetch_timeout_s: float = 5.0
    """Seconds an ``http(s)`` image URL may take to download."""
    media_max_bytes: int = 20 * 2**20
    """Largest image an ``http(s)`` URL, data URL or file may have."""
    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts (lower case) that ``http(s)`` image URLs, and every redirect they take, may
    name (None: any host)."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model's image processor (``--mm-processor-kwargs``), under
    which a request's own ``mm_processor_kwargs`` are merged."""


@dataclass(frozen=True)
class CompilationConfig:
    """Which steps replay from CUDA graphs, in vLLM's terms (``compilation_config``,
    resolved by ``pagedlm.engine.compilation_args``). pagedlm compiles no graph with
    ``torch.compile``: its kernels are Triton's, so only the graph fields act.

    ``cudagraph_mode``: "NONE" (every step eager), "PIECEWISE" (any step up to the
    largest piece size replays the layers between attention calls), "FULL_DECODE_ONLY"
    (uniform steps, decodes and speculative verifications, replay whole), "FULL" (the
    same here: a mixed step's attention cannot be captured whole), "FULL_AND_PIECEWISE"
    (both; the default). Platforms without graphs run every step eagerly whatever it says.
    """

    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    """Sizes to capture (None: the platform's ladders): tokens for pieces, requests for
    whole-step graphs, which are keyed by requests. A decode step's tokens are its
    requests, as in vLLM; a speculative verification step feeds ``1 + k`` tokens per
    request, where vLLM's sizes would count its tokens."""
    max_cudagraph_capture_size: int | None = None
    """The largest size captured (None: the platform's ladders' own bound)."""

    @property
    def full_graphs(self) -> bool:
        return self.cudagraph_mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

    @property
    def piecewise_graphs(self) -> bool:
        return self.cudagraph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE")

    def sizes(self, ladder: list[int]) -> list[int]:
        """The sizes to capture where the platform would capture ``ladder`` (ascending):
        the configured sizes within the ladder's bound, or the ladder itself, cut at
        ``max_cudagraph_capture_size``."""
        bound = ladder[-1] if ladder else 0
        if self.max_cudagraph_capture_size is not None:
            bound = min(bound, self.max_cudagraph_capture_size)
        chosen = ladder if self.cudagraph_capture_sizes is None else self.cudagraph_capture_sizes
        return sorted({s for s in chosen if s <= bound})


@dataclass(frozen=True)
class ReasoningMarkers:
    """The thought's markers as token ids, for grammars that apply after the thought
    (vLLM's ``structured_outputs_config.reasoning_parser``, ``enable_in_reasoning`` off):
    a constrained request is unconstrained until it generates an end marker, and its
    grammar applies to the tokens after it (``structured_output/reasoning.py``)."""

    reasoning_parser: str
    """The reasoning parser whose markers these are (``--reasoning-parser``)."""
    start_token_ids: tuple[int, ...]
    """Tokens that open a thought (may be empty)."""
    end_token_ids: tuple[int, ...]
    """Tokens that end a thought (never empty)."""
    whitespace_token_ids: frozenset[int] = frozenset()
    """Tokens whose text is only whitespace: where the output's first token decides, they
    leave it undecided (free, unseen by the grammar), as the reasoning parsers skip
    leading whitespace before looking for the start marker."""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    platform: str
    """Name of the selected platform (resolved through the plugin registry)."""
    attention_backend: str | None = None
    """None: the platform's default attention backend."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_backend: str = "xgrammar"
    """Grammar backend for structured outputs: "xgrammar" or "outlines"."""
    structured_outputs_compact_json: bool = False
    """Every JSON-constrained request emits compact JSON (vLLM's
    ``structured_outputs_config.disable_any_whitespace``)."""
    structured_outputs_reasoning: ReasoningMarkers | None = None
    """Grammars apply after the model's thought, which ends at one of these markers; None:
    from the first output token (no reasoning parser, ``enable_in_reasoning``, or a
    parser whose markers are no single tokens)."""
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig | None = None
    """A KV connector (``pagedlm.kv_transfer``), or None (off)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding, or None (off)."""
    lora: LoRAConfig | None = None
    """Multi-LoRA serving; None: ``enable_lora`` is off and requests may name no adapter."""
    batch_invariant: bool = False
    """A request's logits are bitwise the same whatever batch it shares and however its
    prompt is chunked (``pagedlm.batch_invariant``); costs speed."""
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    logits_processors: tuple[Any, ...] = ()
    """Custom logits processor classes (``pagedlm.sample.logits_processor``), or their
    qualified names where the config crossed a process boundary."""
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    """Which steps replay from CUDA graphs (vLLM's ``compilation_config``)."""

    def with_num_kv_blocks(self, num_kv_blocks: int) -> EngineConfig:
        return replace(self, cache=replace(self.cache, num_kv_blocks=num_kv_blocks))


def validate_fraction(name: str, value: float) -> None:
    """``value`` must lie in (0, 1]; the error names the ``--kebab-case`` flag too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        flag = "--" + name.replace("_", "-")
        raise ValueError(
            f"{name} must be a fraction in (0, 1], got {value!r}; pass e.g. {flag} 0.9."
        )


def validate_positive(name: str, value: int | None, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
