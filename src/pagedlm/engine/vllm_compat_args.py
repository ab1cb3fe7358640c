"""vLLM's engine arguments that pagedlm takes so that a vLLM command line (or ``LLM(...)``
call) runs unchanged, although nothing of pagedlm's stands behind them.

``VLLM_ONLY`` says for each what becomes of it:

- ignored: tunes something pagedlm does its own way, or not at all, without changing any
  result (loading, logging, metrics, overlap knobs); a value other than vLLM's default is
  logged as having no effect.
- deprecated: deprecated (or since removed) in vLLM itself; logged with vLLM's deprecation
  warning, and taken as the argument that replaced it where there is one
  (``vllm_aliases.py``).
- unsupported: selects a backend or a feature pagedlm does not have; vLLM's default (and
  what means the same here) passes silently, anything else is refused at start, naming
  what is missing and what to use instead. A value that would change results is never
  dropped.

``EngineArgs`` inherits these fields (keyword-only, after its own), so each is a
``--kebab-case`` flag of every subcommand and a keyword of ``LLM(...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

IGNORED, DEPRECATED, UNSUPPORTED = "ignored", "deprecated", "unsupported"


@dataclass(kw_only=True)
class VllmCompatArgs:
    """vLLM's engine arguments without a mechanism of pagedlm's behind them (defaults:
    vLLM's, or None where vLLM's depends on its version)."""

    # ModelConfig
    task: str | None = None
    convert: str = "auto"
    hf_config_path: str | None = None
    code_revision: str | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float | None = None
    config_format: str = "auto"
    allow_deprecated_quantization: bool = False
    enable_return_routed_experts: bool = False
    disable_cascade_attn: bool = False
    override_pooler_config: dict[str, Any] | None = None
    logits_processor_pattern: str | None = None
    override_attention_dtype: str | None = None
    io_processor_plugin: str | None = None
    # LoadConfig
    safetensors_load_strategy: str | None = None
    model_loader_extra_config: dict[str, Any] | None = None
    ignore_patterns: list[str] | None = None
    use_tqdm_on_load: bool = True
    pt_load_map_location: str = "cpu"
    # AttentionConfig
    attention_config: dict[str, Any] | None = None
    # StructuredOutputsConfig (vLLM's flags took a value: --guided-decoding-disable-fallback true)
    guided_decoding_backend: str | None = None
    guided_decoding_disable_fallback: bool | str | None = None
    guided_decoding_disable_any_whitespace: bool | str | None = None
    guided_decoding_disable_additional_properties: bool | str | None = None
    # ParallelConfig
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    nnodes: int = 1
    node_rank: int = 0
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    data_parallel_start_rank: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"
    data_parallel_hybrid_lb: bool = False
    data_parallel_external_lb: bool = False
    all2all_backend: str | None = None
    enable_dbo: bool = False
    ubatch_size: int | None = None
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    disable_nccl_for_dp_synchronization: bool = False
    enable_eplb: bool = False
    eplb_config: dict[str, Any] | None = None
    expert_placement_strategy: str = "linear"
    max_parallel_loading_workers: int | None = None
    ray_workers_use_nsight: bool = False
    disable_custom_all_reduce: bool = False
    worker_cls: str = "auto"
    # CacheConfig
    swap_space: float = 4
    prefix_caching_hash_algo: str = "sha256"
    kv_sharing_fast_prefill: bool = False
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    mamba_cache_mode: str = "none"
    # MultiModalConfig
    enable_mm_embeds: bool = False
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4
    disable_mm_preprocessor_cache: bool = False
    mm_processor_cache_type: str | None = None
    mm_shm_cache_max_object_size_mb: int = 128
    mm_encoder_only: bool = False
    mm_encoder_tp_mode: str = "weights"
    mm_encoder_attn_backend: str | None = None
    interleave_mm_strings: bool = False
    skip_mm_profiling: bool = False
    video_pruning_rate: float | None = None
    # LoRAConfig
    lora_dtype: str = "auto"
    lora_extra_vocab_size: int | None = None
    fully_sharded_loras: bool = False
    default_mm_loras: dict[str, Any] | None = None
    enable_tower_connector_lora: bool = False
    specialize_active_lora: bool = False
    # ObservabilityConfig
    show_hidden_metrics_for_version: str | None = None
    collect_detailed_traces: list[str] | None = None
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    cudagraph_metrics: bool = False
    enable_layerwise_nvtx_tracing: bool = False
    enable_mfu_metrics: bool = False
    enable_logging_iteration_details: bool = False
    # SchedulerConfig
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    disable_chunked_mm_input: bool = False
    scheduler_cls: str | None = None
    disable_hybrid_kv_cache_manager: bool = False
    # CompilationConfig
    cuda_graph_sizes: list[int] | None = None
    # VllmConfig
    ec_transfer_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    profiler_config: dict[str, Any] | None = None
    weight_transfer_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class VllmOnly:
    """What pagedlm does with one of vLLM's arguments."""

    kind: str
    """``IGNORED``, ``DEPRECATED`` or ``UNSUPPORTED``."""
    group: str
    """vLLM's ``--help`` group (its config class)."""
    why: str
    """Why it has no effect or is refused, or (deprecated) vLLM's deprecation warning."""
    fix: str = "drop it"
    """What to do instead (unsupported)."""
    ok: tuple[Any, ...] = ()
    """Values besides the default (and None) taken without a word: what means the same."""


MODEL, LOAD, ATTENTION, STRUCTURED = (
    "ModelConfig", "LoadConfig", "AttentionConfig", "StructuredOutputsConfig",
)  # fmt: skip
PARALLEL, CACHE, MULTIMODAL, LORA = (
    "ParallelConfig",
    "CacheConfig",
    "MultiModalConfig",
    "LoRAConfig",
)
OBSERVABILITY, SCHEDULER, COMPILATION, VLLM = (
    "ObservabilityConfig", "SchedulerConfig", "CompilationConfig", "VllmConfig",
)  # fmt: skip


def _ignored(group: str, why: str, ok: tuple[Any, ...] = ()) -> VllmOnly:
    return VllmOnly(IGNORED, group, why, ok=ok)


def _unsupported(group: str, why: str, fix: str = "drop it", ok: tuple[Any, ...] = ()) -> VllmOnly:
    return VllmOnly(UNSUPPORTED, group, why, fix, ok)


def _deprecated(group: str, warning: str) -> VllmOnly:
    return VllmOnly(DEPRECATED, group, warning)


_GUIDED = _deprecated(
    STRUCTURED,
    "--guided-decoding-* flags are deprecated in vLLM (removed in v0.12); use "
    '--structured-outputs-config \'{"backend": ..., "disable_fallback": ..., '
    '"disable_any_whitespace": ..., "disable_additional_properties": ...}\' (taken as that)',
)
_NO_MAMBA = _ignored(CACHE, "pagedlm's models have no Mamba (state-space) layers")
_ONE_NODE = "an engine and its data-parallel replicas run on one node"
_MULTI_NODE = (
    "use --distributed-executor-backend ray for ranks on several nodes, or one server per "
    "node behind a load balancer"
)
_NO_CP = _unsupported(PARALLEL, "pagedlm has no context parallelism", "use --tensor-parallel-size")
_NO_PARTIAL = _unsupported(
    SCHEDULER, "prompts are not prefilled concurrently in partial chunks (vLLM V1 refuses it too)"
)
_OWN_LB = "one front end balances the replicas of --data-parallel-size"
_OWN_LB_FIX = "drop it, or start one server per replica behind your load balancer"
_IPC = "the data-parallel replicas run on this node and talk over IPC"
_NO_METRIC = _ignored(OBSERVABILITY, "pagedlm does not collect this metric")
_NO_PROCESSOR_CACHE = "there is no processor cache (workers cache image encodings by content)"

VLLM_ONLY: dict[str, VllmOnly] = {
    "task": _deprecated(MODEL, "--task is deprecated in vLLM; use --runner (taken as that)"),
    "convert": _unsupported(
        MODEL, "pagedlm converts no model to another task (the pooling runner pools what "
        "the checkpoint is)", "use --runner pooling with an embedding or classifier "
        "checkpoint", ok=("none",),
    ),
    "hf_config_path": _unsupported(
        MODEL, "the model's config.json is read from its own directory",
        "change its fields with --hf-overrides",
    ),
    "code_revision": _ignored(MODEL, "pagedlm never runs a checkpoint's model code"),
    "rope_scaling": _deprecated(
        MODEL, "--rope-scaling is deprecated in vLLM; use --hf-overrides "
        "'{\"rope_scaling\": {...}}' (taken as that)",
    ),
    "rope_theta": _deprecated(
        MODEL, "--rope-theta is deprecated in vLLM; use --hf-overrides "
        "'{\"rope_theta\": ...}' (taken as that)",
    ),
    "config_format": _unsupported(
        MODEL, "pagedlm reads Hugging Face config.json files only", ok=("hf",)
    ),
    "allow_deprecated_quantization": _ignored(
        MODEL, "pagedlm has no deprecated quantization methods"
    ),
    "enable_return_routed_experts": _unsupported(
        MODEL, "outputs do not carry MoE routing decisions"
    ),
    "disable_cascade_attn": _ignored(MODEL, "pagedlm has no cascade attention", ok=(True,)),
    "override_pooler_config": _deprecated(
        MODEL, "--override-pooler-config is deprecated in vLLM; use --pooler-config "
        "(taken as that)",
    ),
    "logits_processor_pattern": _unsupported(
        MODEL, "requests cannot name logits processors",
        "install them for every request with --logits-processors",
    ),
    "override_attention_dtype": _unsupported(
        MODEL, "attention computes in the model's dtype", "drop it, or change --dtype"
    ),
    "io_processor_plugin": _unsupported(MODEL, "pagedlm has no IO processor plugins"),
    "safetensors_load_strategy": _ignored(
        LOAD, "pagedlm memory-maps safetensors files", ok=("lazy",)
    ),
    "model_loader_extra_config": _unsupported(
        LOAD, "pagedlm's loaders take no extra configuration (vLLM's tensorizer, "
        "sharded-state, ... loaders)", ok=({},),
    ),
    "ignore_patterns": _ignored(
        LOAD, "pagedlm reads only the weight files its loader needs",
        ok=(["original/**/*"], []),
    ),
    "use_tqdm_on_load": _ignored(LOAD, "cosmetic", ok=(False,)),
    "pt_load_map_location": _ignored(
        LOAD, "PyTorch weight files are always read onto the CPU first"
    ),
    "attention_config": _unsupported(
        ATTENTION, "vLLM's attention backends and their options are not pagedlm's",
        "choose one of pagedlm's backends with --attention-backend", ok=({},),
    ),
    "guided_decoding_backend": _GUIDED,
    "guided_decoding_disable_fallback": _GUIDED,
    "guided_decoding_disable_any_whitespace": _GUIDED,
    "guided_decoding_disable_additional_properties": _GUIDED,
    "master_addr": _ignored(PARALLEL, "it is read with --nnodes > 1 only"),
    "master_port": _ignored(PARALLEL, "it is read with --nnodes > 1 only"),
    "nnodes": _unsupported(PARALLEL, _ONE_NODE, _MULTI_NODE),
    "node_rank": _unsupported(PARALLEL, _ONE_NODE, _MULTI_NODE),
    "decode_context_parallel_size": _NO_CP,
    "prefill_context_parallel_size": _NO_CP,
    "dcp_kv_cache_interleave_size": _ignored(PARALLEL, "it is read with context parallelism"),
    "cp_kv_cache_interleave_size": _ignored(PARALLEL, "it is read with context parallelism"),
    "data_parallel_start_rank": _unsupported(PARALLEL, _ONE_NODE, _MULTI_NODE, ok=(0,)),
    "data_parallel_size_local": _unsupported(
        PARALLEL, _ONE_NODE, "drop it: the --data-parallel-size replicas all run on this node"
    ),
    "data_parallel_address": _ignored(PARALLEL, _IPC),
    "data_parallel_rpc_port": _ignored(PARALLEL, _IPC),
    "data_parallel_backend": _unsupported(
        PARALLEL, "data-parallel replicas are processes of this node",
        "drop it (each replica's ranks may still use --distributed-executor-backend ray)",
    ),
    "data_parallel_hybrid_lb": _unsupported(PARALLEL, _OWN_LB, _OWN_LB_FIX),
    "data_parallel_external_lb": _unsupported(PARALLEL, _OWN_LB, _OWN_LB_FIX),
    "all2all_backend": _ignored(
        PARALLEL, "pagedlm's expert parallelism has one exchange of its own"
    ),
    "enable_dbo": _unsupported(PARALLEL, "pagedlm has no dual-batch overlap"),
    "ubatch_size": _ignored(PARALLEL, "it is read with --enable-dbo only"),
    "dbo_decode_token_threshold": _ignored(PARALLEL, "it is read with --enable-dbo only"),
    "dbo_prefill_token_threshold": _ignored(PARALLEL, "it is read with --enable-dbo only"),
    "disable_nccl_for_dp_synchronization": _ignored(
        PARALLEL, "data-parallel replicas do not synchronize their steps here", ok=(True,)
    ),
    "enable_eplb": _unsupported(
        PARALLEL, "pagedlm has no expert-parallel load balancer (EPLB)",
        "drop it (--enable-expert-parallel shards the experts evenly)",
    ),
    "eplb_config": _ignored(PARALLEL, "it is read with --enable-eplb only", ok=({},)),
    "expert_placement_strategy": _unsupported(
        PARALLEL, "experts are placed in contiguous ranges over the ranks"
    ),
    "max_parallel_loading_workers": _ignored(PARALLEL, "each rank loads its own shard"),
    "ray_workers_use_nsight": _ignored(
        PARALLEL, "run the server under nsys to profile its workers"
    ),
    "disable_custom_all_reduce": _ignored(
        PARALLEL, "pagedlm reduces with torch.distributed only", ok=(True,)
    ),
    "worker_cls": _unsupported(
        PARALLEL, "the worker class is not replaceable",
        "add methods to every worker with --worker-extension-cls, or register an executor "
        "plugin",
    ),
    "swap_space": _ignored(
        CACHE, "a preempted request is recomputed, never swapped to host memory "
        "(--kv-offloading-size GiB keeps computed blocks in host memory)",
    ),
    "prefix_caching_hash_algo": _unsupported(
        CACHE, "blocks are hashed with sha256 over pagedlm's own encoding",
        "drop it (KV events carry these sha256 hashes)",
    ),
    "kv_sharing_fast_prefill": _unsupported(
        CACHE, "pagedlm has no fast prefill over layers that share KV"
    ),
    "mamba_cache_dtype": _NO_MAMBA,
    "mamba_ssm_cache_dtype": _NO_MAMBA,
    "mamba_block_size": _NO_MAMBA,
    "mamba_cache_mode": _NO_MAMBA,
    "enable_mm_embeds": _unsupported(
        MULTIMODAL, "images come as images (URLs, data URLs, PIL images), not as embeddings"
    ),
    "media_io_kwargs": _unsupported(
        MULTIMODAL, "images are decoded by PIL without options, and there is no video or "
        "audio input", ok=({},),
    ),
    "mm_processor_cache_gb": _ignored(MULTIMODAL, _NO_PROCESSOR_CACHE, ok=(0,)),
    "disable_mm_preprocessor_cache": _deprecated(
        MULTIMODAL, "--disable-mm-preprocessor-cache is deprecated in vLLM; use "
        "--mm-processor-cache-gb 0 (no effect here: there is no processor cache)",
    ),
    "mm_processor_cache_type": _ignored(MULTIMODAL, _NO_PROCESSOR_CACHE, ok=("lru",)),
    "mm_shm_cache_max_object_size_mb": _ignored(MULTIMODAL, _NO_PROCESSOR_CACHE),
    "mm_encoder_only": _unsupported(
        MULTIMODAL, "pagedlm does not serve a vision encoder alone"
    ),
    "mm_encoder_tp_mode": _unsupported(
        MULTIMODAL, "the vision encoder's weights are split over the tensor-parallel ranks "
        "as the model's are",
    ),
    "mm_encoder_attn_backend": _unsupported(
        MULTIMODAL, "the platform chooses the vision encoder's attention"
    ),
    "interleave_mm_strings": _unsupported(
        MULTIMODAL, "a message's image parts go where its chat template puts them"
    ),
    "skip_mm_profiling": _ignored(MULTIMODAL, "the start-up profile runs no vision encoder"),
    "video_pruning_rate": _unsupported(MULTIMODAL, "there is no video input", ok=(0,)),
    "lora_dtype": _unsupported(
        LORA, "adapters compute in the model's dtype",
        "drop it, or set --dtype to it (adapters follow)",
    ),
    "lora_extra_vocab_size": _deprecated(
        LORA, "--lora-extra-vocab-size is deprecated in vLLM (removed in v0.12); no effect "
        "here: adapters cannot add tokens",
    ),
    "fully_sharded_loras": _ignored(
        LORA, "adapters' weights are replicated on every tensor-parallel rank"
    ),
    "default_mm_loras": _unsupported(
        LORA, "no adapter is applied by a prompt's modality", "name the adapter in each "
        "request", ok=({},),
    ),
    "enable_tower_connector_lora": _unsupported(
        LORA, "adapters apply to the language model only"
    ),
    "specialize_active_lora": _ignored(
        LORA, "adapter kernels take the step's adapters as they come"
    ),
    "show_hidden_metrics_for_version": _ignored(OBSERVABILITY, "pagedlm hides no metrics"),
    "collect_detailed_traces": _ignored(
        OBSERVABILITY, "traces have one span per request (--otlp-traces-endpoint)"
    ),
    "kv_cache_metrics": _NO_METRIC,
    "kv_cache_metrics_sample": _NO_METRIC,
    "cudagraph_metrics": _NO_METRIC,
    "enable_layerwise_nvtx_tracing": _ignored(OBSERVABILITY, "pagedlm adds no NVTX ranges"),
    "enable_mfu_metrics": _NO_METRIC,
    "enable_logging_iteration_details": _ignored(
        OBSERVABILITY, "pagedlm logs no per-step details"
    ),
    "max_num_partial_prefills": _NO_PARTIAL,
    "max_long_partial_prefills": _NO_PARTIAL,
    "disable_chunked_mm_input": _ignored(
        SCHEDULER, "an image is encoded whole in the step whose chunk first reaches it"
    ),
    "scheduler_cls": _unsupported(
        SCHEDULER, "pagedlm's scheduler is not replaceable",
        ok=("vllm.v1.core.sched.scheduler.Scheduler",),
    ),
    "disable_hybrid_kv_cache_manager": _ignored(
        SCHEDULER, "every layer shares one KV-cache layout", ok=(True,)
    ),
    "cuda_graph_sizes": _deprecated(
        COMPILATION, "--cuda-graph-sizes is deprecated in vLLM; use --cudagraph-capture-sizes "
        "(taken as that)",
    ),
    "ec_transfer_config": _unsupported(
        VLLM, "pagedlm has no encoder-cache transfer", ok=({},)
    ),
    "additional_config": _unsupported(
        VLLM, "pagedlm's platforms take no additional_config",
        "configure a platform plugin through its own settings", ok=({},),
    ),
    "profiler_config": _unsupported(
        VLLM, "pagedlm's profiler is torch's, without options",
        "serve with --profiler-dir DIR (POST /start_profile, /stop_profile)", ok=({},),
    ),
    "weight_transfer_config": _unsupported(
        VLLM, "pagedlm has no weight-transfer backends",
        "serve with --enable-weight-updates (POST /update_weights_from_disk)", ok=({},),
    ),
}  # fmt: skip
"""What becomes of each ``VllmCompatArgs`` field."""

_DEFAULTS = {field.name: field.default for field in dataclasses.fields(VllmCompatArgs)}


def is_silent(name: str, value: Any) -> bool:
    """Whether ``value`` of the field ``name`` is taken without a word: vLLM's default,
    None, or what means the same here."""
    return value is None or value == _DEFAULTS[name] or value in VLLM_ONLY[name].ok


def vllm_only_help(name: str) -> str | None:
    """``--help`` text of a ``VllmCompatArgs`` field's flag (None for other fields)."""
    spec = VLLM_ONLY.get(name)
    if spec is None:
        return None
    if spec.kind == IGNORED:
        return f"vLLM's flag, accepted without effect: {spec.why}."
    if spec.kind == DEPRECATED:
        return f"[DEPRECATED] {spec.why}."
    return f"vLLM's flag; only its default is accepted: {spec.why} ({spec.fix})."
