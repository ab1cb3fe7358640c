"""Engine arguments, declared once and shared by ``LLM``, the async engine and the CLI.

``EngineArgs.create_engine_config()`` is the edge: it resolves the model, selects the
platform and validates everything, raising ``ValueError`` that names the argument to fix.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagedlm.batch_invariant import batch_invariant_from_env
from pagedlm.config import (
    ArchConfig,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    parse_dtype,
    validate_fraction,
    validate_positive,
)
from pagedlm.engine.compilation_args import resolve_compilation
from pagedlm.engine.kv_transfer_args import check_kv_transfer_config, offloading_transfer_config
from pagedlm.engine.model_impl_args import (
    check_transformers_backend,
    check_transformers_parallel,
    resolve_model_impl,
)
from pagedlm.engine.prompt_embeds import check_prompt_embeds_config
from pagedlm.engine.quantization_args import check_quantization_name, resolve_quantization
from pagedlm.engine.reasoning_args import merge_reasoning_fields, reasoning_markers
from pagedlm.engine.speculative_args import parse_speculative_config
from pagedlm.engine.structured_outputs_args import resolve_structured_outputs
from pagedlm.engine.vllm_compat_args import VllmCompatArgs
from pagedlm.generation_config import sampling_defaults
from pagedlm.kv_cache.fp8 import validate_kv_cache_dtype
from pagedlm.model_executor.loader.hub import looks_like_hub_id, resolve_model_path
from pagedlm.model_executor.weight_offload import offload_budget_bytes

if TYPE_CHECKING:
    from pagedlm.platforms import Platform

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineArgs(VllmCompatArgs):
    """Every engine argument, by vLLM's names. Those below act; ``VllmCompatArgs`` (whose
    keyword-only fields come after these) holds the vLLM arguments taken for compatibility
    that have no mechanism of pagedlm's behind them."""

    model: str | None = None
    """Local HF directory (config.json + safetensors), .gguf file, or hub id (``org/name``,
    fetched with huggingface_hub); None: the embedded default model (SmolLM2-135M-Instruct)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; None: the model's own."""
    tokenizer_mode: str = "auto"
    """"auto" or "hf" (transformers' fast tokenizer where the checkpoint has one), or "slow"
    (its Python tokenizer), vLLM's names; "mistral" is refused (no mistral_common)."""
    revision: str | None = None
    """Branch, tag or commit of a hub id (model and, when it is a hub id too, tokenizer)."""
    tokenizer_revision: str | None = None
    """Branch, tag or commit of the tokenizer's hub id (vLLM's flag): of ``tokenizer``, or
    of the model's repository, read for its tokenizer files only; None: ``revision``."""
    load_format: str = "auto"
    """"auto": a .gguf file by its name, else the directory's *.safetensors, falling back
    to PyTorch pytorch_model*.bin (sharded through pytorch_model.bin.index.json) or *.pt
    files where it has none; "safetensors"; "pt": the PyTorch .bin/.pt files, read with
    torch.load(weights_only=True) (a trainer's training_args.bin, optimizer.pt, ... are
    never read); "gguf"; or "dummy": random weights of the configured shapes, no weight
    files needed (a directory with only config.json works)."""
    quantization: str | None = None
    """None, "bitsandbytes" to quantize linear layers at load (needs pagedlm[bnb]), or "fp8":
    E4M3 weights with per-channel scales (float checkpoints quantized at load; FP8
    checkpoints, vLLM "fp8" or "compressed-tensors", are read as FP8 without it). GPTQ,
    AWQ and integer compressed-tensors checkpoints are read as such without it ("gptq",
    "awq", "compressed-tensors"; vLLM's "gptq_marlin", "awq_marlin" name the same)."""
    bnb_quant_type: str = "nf4"
    """With quantization="bitsandbytes": "nf4" or "fp4" (4-bit), or "int8"."""
    dtype: str = "auto"
    """"auto" (the checkpoint's dtype if the platform runs it), "float32", "bfloat16" or
    "float16"."""
    seed: int = 0
    """Seed of the model's random state and of requests sampled without their own seed."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """Fixed number of KV-cache blocks; None: as many as the platform's memory budget holds."""
    num_gpu_blocks_override: int | None = None
    """vLLM's name for num_kv_blocks (either may be given; both only with one value)."""
    max_num_seqs: int = 256
    """Most requests in one step's batch."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (longer prompts are prefilled in chunks); None: the
    platform's default (8192 on GPUs, 2048 on CPU), or max_num_seqs if larger."""
    max_model_len: int | None = None
    """Longest prompt + output a request may have; None: the model's context length. Every
    request must fit the KV cache at this length, so lowering it helps a cache that is too
    small."""
    disable_sliding_window: bool = False
    """vLLM's switch: cap the context at the model's sliding window, where sliding-window
    attention and full attention are the same (ignored for models without a window)."""
    async_scheduling: bool | None = None
    """Schedule each step while the previous one still runs on the device (vLLM's flag), so
    the host's per-step work (scheduling, stops, outputs) hides behind the device's; None:
    the platform's default (on for CUDA and ROCm, off on CPU, where nothing overlaps)."""
    scheduling_policy: str = "fcfs"
    """"fcfs": requests start in arrival order; "priority": by each request's ``priority``
    (lower first, ties in arrival order), and memory pressure preempts the
    lowest-priority running request first."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids, and outputs carry no text."""
    platform: str | None = None
    """Platform name (cpu, cuda, rocm or a plugin's); None: PAGEDLM_PLATFORM, else the best
    available."""
    attention_backend: str | None = None
    """Attention backend name; None: the platform's default."""
    kv_cache_memory_bytes: int | None = None
    """Bytes the KV cache may take (overrides the platform's sizing; ignored with
    num_kv_blocks)."""
    gpu_memory_utilization: float = 0.9
    """Fraction in (0, 1] of GPU memory the engine may use in all (weights, activations,
    KV cache); the KV cache gets what is left after the profiling forward. CPU platforms
    accept and ignore it (their KV budget is PAGEDLM_CPU_KVCACHE_SPACE GiB)."""
    cpu_offload_gb: float = 0
    """GiB of the model's weights (per device) kept in the host's pinned memory and read by
    the device in place at every step (vLLM's flag): room for a model or a KV cache the
    device cannot otherwise hold, at the host link's speed for those weights; 0: none.
    No effect on the CPU platform."""
    kv_cache_dtype: str = "auto"
    """"auto" (the model's dtype; "float16"/"bfloat16" name it, refused for another model
    dtype) or "fp8" (= "fp8_e4m3", vLLM's names): keys and values stored in float8 E4M3
    with per-layer scales, half the bytes, twice the blocks."""
    calculate_kv_scales: bool = False
    """With kv_cache_dtype="fp8": measure each layer's k/v scales on the first step (vLLM's
    flag) instead of reading the checkpoint's k_scale/v_scale (default 1.0)."""
    logits_processors: list[Any] | None = None
    """Custom logits processors: classes (``LLM(...)`` in this process) or qualified names
    ('package.module:Class'), subclasses of pagedlm.sample.logits_processor.LogitsProcessor;
    those installed under the 'pagedlm.logits_processors' entry points are added."""
    batch_invariant: bool = False
    """Make each request's logits bitwise independent of the batch it shares and of how its
    prompt is chunked (fixed reduction orders; slower). The VLLM_BATCH_INVARIANT=1
    environment variable (vLLM's switch) turns it on too."""
    enforce_eager: bool = False
    """Never replay steps from CUDA graphs (skips capturing them at start-up)."""
    compilation_config: dict[str, Any] | str | None = None
    """vLLM's compilation config (JSON): of it pagedlm takes the CUDA-graph fields,
    cudagraph_mode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE),
    cudagraph_capture_sizes and max_cudagraph_capture_size; it compiles nothing with
    torch.compile, so other compiler options are refused."""
    optimization_level: int = 2
    """vLLM's -O0 .. -O3: the default graph mode (0: no CUDA graphs, 1: piecewise, 2 and
    3: full and piecewise); compilation_config's cudagraph_mode wins."""
    cudagraph_capture_sizes: list[int] | None = None
    """Batch sizes captured as CUDA graphs (vLLM's flag, compilation_config's
    cudagraph_capture_sizes; give it in one of the two places), e.g. 1 2 4 8; None: the
    platform's sizes up to max_cudagraph_capture_size."""
    max_cudagraph_capture_size: int | None = None
    """The largest batch size captured as a CUDA graph (vLLM's flag, compilation_config's
    max_cudagraph_capture_size; give it in one of the two places)."""
    enable_prompt_embeds: bool = False
    """Accept prompts given as input embeddings (vLLM's flag): ``{"prompt_embeds": tensor
    [num_tokens, hidden_size]}``, or base64 ``torch.save`` bytes over HTTP. Off by default:
    a malformed tensor from an untrusted client costs memory and compute."""
    enable_sleep_mode: bool = False
    """Allow sleep and wake_up (vLLM's flag; LLM.sleep, POST /sleep?level=1|2): level 1
    moves the weights to host memory and frees the KV cache, level 2 drops the weights too
    (for weights about to be replaced)."""
    trust_remote_code: bool = False
    """Let the tokenizer run code shipped with the checkpoint (transformers' flag); a
    checkpoint's model code is never run."""
    hf_overrides: dict[str, Any] | None = None
    """Fields that replace the model's config.json ones (vLLM's flag), as JSON, e.g.
    '{"max_position_embeddings": 4096}'; a nested object merges into the nested one."""
    download_dir: str | None = None
    """Where hub models are downloaded (None: the Hugging Face cache)."""
    hf_token: bool | str | None = dataclasses.field(default=None, repr=False)
    """The token sent with every request to the Hugging Face hub (vLLM's flag; model,
    tokenizer, draft model): the token itself, or True (--hf-token without a value) for the
    one `hf auth login` stored; None: huggingface_hub's default (HF_TOKEN, else the stored
    one). Never logged."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps within the token budget (vLLM's flag; on).
    Off: a prompt waits for a step with room for all of it, so max_num_batched_tokens
    must hold max_model_len tokens."""
    long_prefill_token_threshold: int = 0
    """A prompt computes at most this many tokens per step (vLLM's flag), so one long
    prompt does not take a step's whole budget from the others; 0: no cap."""
    disable_log_stats: bool = False
    """No periodic line of throughput, running and waiting requests and KV-cache usage
    (vLLM's flag; the server logs one every 10 s while busy), and for an ``LLM``, no
    metrics at all: ``LLM(...)`` defaults it to True, as vLLM's, and its ``get_metrics``
    needs ``disable_log_stats=False``."""
    aggregate_engine_logging: bool = False
    """One periodic stats line for all data-parallel replicas ("N Engines Aggregated:
    ..."), instead of one per replica ("Engine 000: ..."), as vLLM's flag."""
    stream_interval: int = 1
    """Hand a running request's output to the caller (a stream, an async generator) every
    this many new tokens after its first ones (vLLM's flag): larger values cost the front
    end less per token when it serves many streams, and make each chunk longer."""
    max_logprobs: int = 20
    """The most logprobs (and prompt logprobs) per token a request may ask for (vLLM's
    flag); -1: the whole vocabulary."""
    logprobs_mode: str = "raw_logprobs"
    """What sampled tokens' logprobs report (vLLM's flag): "raw_logprobs" the model's
    distribution, "processed_logprobs" the one the token was sampled from (after logit
    bias, penalties, temperature, top-k/top-p/min-p), "raw_logits" / "processed_logits"
    the logits themselves. Prompt logprobs are always raw logprobs."""
    generation_config: str = "auto"
    """Where requests' default sampling parameters come from (vLLM's flag): "auto" the
    model's generation_config.json (its temperature, top_p, top_k, min_p,
    repetition_penalty, and max_new_tokens as the default max_tokens), "vllm" none
    (pagedlm's own defaults), or a directory holding a generation_config.json."""
    override_generation_config: dict[str, Any] | None = None
    """Sets or replaces those defaults, as vLLM's JSON, e.g. '{"temperature": 0.5}' (alone
    with generation_config="vllm")."""
    structured_outputs_backend: str = "auto"
    """Grammar backend for structured outputs: "xgrammar", "outlines", or "auto" (vLLM's
    default: xgrammar, or outlines where only it is installed)."""
    structured_outputs_config: dict[str, Any] | None = None
    """vLLM's JSON for structured outputs, e.g. '{"backend": "xgrammar",
    "disable_any_whitespace": true}' (compact JSON for every request), or
    '{"reasoning_parser": "qwen3"}' (grammars apply after the model's thought;
    --reasoning-parser sets it for the server); keys in
    ``pagedlm.engine.structured_outputs_args``."""
    reasoning_parser: str = ""
    """How the model's thought (<think>...</think> and kin) is told from its answer, by
    vLLM's reasoning parser names (``--help`` of serve lists them): the server returns it as
    reasoning_content, and grammars apply after it. vLLM's shorthand for
    structured_outputs_config's reasoning_parser (either sets both; two different ones are
    refused). deepseek_r1: the output starts inside the thought; qwen3: only after
    <think>."""
    reasoning_parser_plugin: str = ""
    """A .py file (or module name) that registers reasoning parsers of its own with
    pagedlm.entrypoints.openai.reasoning_parsers.register_reasoning_parser (shorthand for
    structured_outputs_config's reasoning_parser_plugin)."""
    kv_events_config: str | None = None
    """Publish prefix-cache block events as vLLM does, as a JSON object (a dict from
    Python), e.g. '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558"}'; off by default."""
    kv_transfer_config: dict[str, Any] | str | None = None
    """A KV connector, as vLLM's JSON (a dict or KVTransferConfig from Python), e.g.
    '{"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config":
    {"shared_storage_path": "/tmp/kv"}}': save prompts' KV for other engines (kv_producer),
    load theirs instead of computing it (kv_consumer), or both; off by default."""
    kv_offloading_size: float | None = None
    """GiB of host memory that keep computed KV blocks for later prompts with the same
    prefix, a second tier under the prefix cache (vLLM's flag; builds the
    OffloadingConnector's kv_transfer_config, so not together with one); None: off."""
    kv_offloading_backend: str = "native"
    """What offloads with kv_offloading_size: "native" (pagedlm's host-memory pool, vLLM's
    default); vLLM's "lmcache" is not available here."""
    tensor_parallel_size: int = 1
    """Ranks each layer's heads, MLP and vocabulary are split over (one all-reduce per
    attention and per MLP block)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split over (intermediate activations go stage to stage)."""
    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler, KV cache and workers, behind one
    front end that sends each request to the least loaded."""
    data_parallel_rank: int = 0
    """Which replica this engine is (set by the front end for each replica it starts)."""
    enable_expert_parallel: bool = False
    """Shard MoE experts whole over the tensor-parallel ranks instead of slicing each."""
    distributed_executor_backend: str | None = None
    """"uni" (one worker in the engine's process), "mp" (a worker process per rank), "ray"
    (Ray actors, for several nodes) or a plugin's executor; None: "uni" for one worker,
    "mp" for several on one node, "ray" when the node has too few devices or this process
    is in a Ray placement group."""
    worker_extension_cls: str | None = None
    """A class whose methods are added to every worker, for collective_rpc (vLLM's), as
    'package.module:Class' or 'package.module.Class' (a class from Python); importable in
    every worker process, with no attribute the worker has. Checked at start-up."""
    speculative_config: dict[str, Any] | str | None = None
    """Speculative decoding, vLLM's keys as a dict or JSON, e.g. '{"method": "ngram",
    "num_speculative_tokens": 4}'; methods ngram (prompt_lookup_min/max), draft_model,
    eagle and eagle3 (with "model"), mtp (a DeepSeek checkpoint's own
    multi-token-prediction layer). None: off."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) named per request, batched with the base
    model and with each other in the same steps."""
    max_loras: int = 1
    """With enable_lora: most distinct adapters in one step (device slots)."""
    max_lora_rank: int = 16
    """With enable_lora: largest adapter rank accepted (device slots are this wide)."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters cached in host memory (None: max_loras); at least
    max_loras."""
    model_impl: str = "auto"
    """Which implementation runs the model (vLLM's flag): "vllm" (alias "pagedlm") pagedlm's
    own model classes, "transformers" the Transformers modeling backend (transformers'
    modeling code with pagedlm's paged attention: no tensor/pipeline parallelism,
    quantization, LoRA, pooling or EAGLE, no CUDA graphs), "auto" pagedlm's own class where
    there is one, else the backend where transformers can run the architecture."""
    runner: str = "auto"
    """"generate" (sample tokens), "pooling" (one vector per prompt: LLM.embed, /v1/embeddings)
    or "auto": pooling for embedding checkpoints (BertModel, Qwen3Model-style decoders without
    LM head, sentence-transformers directories), else generate."""
    pooler_config: dict[str, Any] | None = None
    """A pooling model's pooling over what its checkpoint says, as vLLM's JSON, e.g.
    '{"pooling_type": "MEAN", "normalize": false}' (keys: pooling_type, seq_pooling_type,
    normalize, use_activation)."""

    limit_mm_per_prompt: dict[str, int] | None = None
    """Most images per prompt as vLLM's JSON, e.g. '{"image": 2}' (None: 999)."""
    allowed_local_media_path: str | None = None
    """Directory from which ``file://`` image URLs may be read (None: none may)."""
    media_fetch_timeout_s: float = 5.0
    """Seconds an http(s) image URL may take to download."""
    media_max_bytes: int = 20 * 2**20
    """Largest image (bytes) a URL, data URL or file may carry."""
    allowed_media_domains: list[str] | None = None
    """Hosts that http(s) image URLs may come from, e.g. upload.wikimedia.org (exact
    host names; a redirect to any other host is refused too). None: any host."""
    mm_processor_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments for the model's image processor as JSON, e.g. '{"max_pixels":
    802816}' (Qwen2.5-VL); the keys the processor takes, checked at start-up. A chat
    request's own mm_processor_kwargs override them."""
    max_num_encoder_input_tokens: int | None = None
    """Image embedding rows the vision encoder may produce per step (None: the token
    budget, max_num_batched_tokens)."""
    encoder_cache_size: int | None = None
    """Image embedding rows kept cached beyond what running requests need (None: the
    encoder budget)."""

    structured_outputs_max_spec_chars: int = 65536
    """Longest JSON schema, regex, grammar or choice list (as canonical JSON text) a
    request may constrain with; longer ones get 400 before compiling (0: no limit)."""
    structured_outputs_compile_timeout_s: float = 10.0
    """A request whose grammar has compiled this long fails with 400 (0: no limit); the
    compile itself runs on, off the engine loop, and other grammars do not wait for it."""
    engine_iteration_timeout_s: float = 60.0
    """/health says the engine core is hung when one step runs longer than this per
    started 1024 tokens it computes (at least 10x the slowest per-token time seen so far);
    vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S."""
    engine_heartbeat_timeout_s: float = 5.0
    """/health says the engine core is unresponsive (stopped, frozen or dead) after this
    many seconds without its heartbeat, which it sends every 0.5 s, during steps too."""

    def __post_init__(self) -> None:
        if isinstance(self.worker_extension_cls, type):  # its name crosses processes
            from pagedlm.qualified_names import qualified_name

            self.worker_extension_cls = qualified_name(self.worker_extension_cls)
        # A dict (or KVEventsConfig) from Python travels as the CLI's JSON text, so the
        # arguments stay JSON-serializable for the engine-core process.
        if self.kv_events_config is not None and not isinstance(self.kv_events_config, str):
            self.kv_events_config = json.dumps(
                dataclasses.asdict(KVEventsConfig.parse(self.kv_events_config))
            )
        if isinstance(self.kv_transfer_config, KVTransferConfig):
            self.kv_transfer_config = dataclasses.asdict(self.kv_transfer_config)
        self.structured_outputs_config = merge_reasoning_fields(self)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def resolve_model(self) -> str:
        """A local directory or .gguf path for ``model`` (downloading a hub id if needed)."""
        if self.model is None:
            if self.revision is not None:
                raise ValueError("revision= needs model=<a hub id>; the default model has none.")
            from pagedlm.model_executor.loader.default_model import default_model_path

            return default_model_path()
        return resolve_model_path(
            "Model",
            str(self.model),
            self.revision,
            cache_dir=self.download_dir,
            load_format=self.load_format,
            token=self.hf_token,
        )

    def resolve_tokenizer(self) -> str | None:
        """The tokenizer's local path; None: the model's own files."""
        revision = self.tokenizer_revision or self.revision
        if self.tokenizer is None:
            if self.tokenizer_revision is None:
                return None
            if self.model is None or not looks_like_hub_id(str(self.model)):
                raise ValueError(
                    "tokenizer_revision applies to a hub id (tokenizer=, or the model's); "
                    "drop it for a local model."
                )
            source = str(self.model)
        else:
            source = str(self.tokenizer)
        return resolve_model_path(
            "Tokenizer",
            source,
            revision,
            weights=False,
            cache_dir=self.download_dir,
            token=self.hf_token,
        )

    def create_engine_config(self, log_defaults: bool = True) -> tuple[EngineConfig, Platform]:
        """The engine's configuration and platform; ``log_defaults=False`` keeps the
        sampling defaults and the notes on vLLM's arguments out of the log (the engine-core
        process: its front end logged them when it resolved the same arguments)."""
        from pagedlm.engine.vllm_aliases import resolve_vllm_args

        return resolve_vllm_args(self, warn=log_defaults)._engine_config(log_defaults)

    def _engine_config(self, log_defaults: bool) -> tuple[EngineConfig, Platform]:
        from pagedlm.multimodal.config_args import multimodal_config
        from pagedlm.plugins.registry import configure, select_platform

        for name in (
            "block_size",
            "max_num_seqs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
        ):
            validate_positive(name, getattr(self, name), allow_none=False)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_rank} is outside 0 .. "
                f"data_parallel_size - 1 = {self.data_parallel_size - 1}."
            )
        for name in (
            "num_kv_blocks",
            "num_gpu_blocks_override",
            "max_num_batched_tokens",
            "max_model_len",
        ):
            validate_positive(name, getattr(self, name))
        num_kv_blocks = self._num_kv_blocks()
        validate_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        offload_budget_bytes(self.cpu_offload_gb)
        self._check_operability_limits()
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown; use one of "
                f"{list(SCHEDULING_POLICIES)}."
            )

        self._check_loading_options()
        from pagedlm.tokenizer import check_tokenizer_mode

        check_tokenizer_mode(self.tokenizer_mode)
        grammar_backend, compact_json = resolve_structured_outputs(
            self.structured_outputs_backend, self.structured_outputs_config
        )
        model = self.resolve_model()
        self._check_weight_files(model)
        if model.endswith(".gguf"):
            from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config

            arch = gguf_arch_config(model)
        else:
            arch = ArchConfig.from_directory(model)
        if self.hf_overrides:
            if model.endswith(".gguf"):
                raise ValueError(
                    "hf_overrides replaces config.json fields, and a .gguf file has none; "
                    "drop hf_overrides or use the model's Hugging Face directory."
                )
            arch = ArchConfig.from_hf_dict(_merged(arch.raw, self.hf_overrides))
        if arch.raw.get("classifier_from_token"):
            from pagedlm.pooling.model_config import with_classifier_token_ids
            from pagedlm.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(model, self.resolve_tokenizer(), mode=self.tokenizer_mode)
            arch = with_classifier_token_ids(arch, tokenizer)
        model_impl, arch = resolve_model_impl(self.model_impl, arch, model)
        check_transformers_parallel(
            model_impl, arch, self.tensor_parallel_size, self.pipeline_parallel_size
        )
        if self.load_format != "dummy" and not model.endswith(".gguf"):
            self._check_checkpoint_files(model, arch)  # before any memory is allocated

        quantization, bnb_quant_type = resolve_quantization(
            self.quantization, self.bnb_quant_type, arch
        )
        platform = select_platform(self.platform)
        if self.dtype == "auto":
            config_dtype = parse_dtype(arch.torch_dtype) if arch.torch_dtype else None
            dtype = platform.default_dtype(config_dtype)
        else:
            dtype = parse_dtype(self.dtype)
            platform.check_dtype(dtype)

        max_model_len = self._max_model_len(arch)
        max_num_batched_tokens = self.max_num_batched_tokens or max(
            platform.default_max_num_batched_tokens, self.max_num_seqs
        )
        runner, pooler = self._runner(arch, model)
        whole_prompts = not self.enable_chunked_prefill or (
            runner == "pooling" and not _chunks_prompts(arch, pooler, self.max_num_batched_tokens)
        )
        if whole_prompts:
            max_num_batched_tokens = self._whole_prompt_budget(
                max_model_len,
                platform.default_max_num_batched_tokens,
                "runner='pooling'" if runner == "pooling" else "enable_chunked_prefill=False",
            )
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=self.resolve_tokenizer(),
                tokenizer_mode=self.tokenizer_mode,
                arch=arch,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                skip_tokenizer_init=self.skip_tokenizer_init,
                load_format=self.load_format,
                revision=self.revision,
                quantization=quantization,
                bnb_quant_type=bnb_quant_type,
                trust_remote_code=self.trust_remote_code,
                enable_sleep_mode=self.enable_sleep_mode,
                enforce_eager=self.enforce_eager,
                enable_prompt_embeds=self.enable_prompt_embeds,
                runner=runner,
                pooler=pooler,
                model_impl=model_impl,
                max_logprobs=self._max_logprobs(arch),
                logprobs_mode=self._logprobs_mode(),
                sampling_defaults=(
                    sampling_defaults(
                        model,
                        self.generation_config,
                        self.override_generation_config,
                        log=log_defaults,
                    )
                    if runner == "generate"
                    else {}
                ),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=num_kv_blocks,
                # A pooling model whose pooler reads every row (or whose attention looks
                # ahead) takes nothing from the cache.
                enable_prefix_caching=self.enable_prefix_caching
                and (pooler is None or _caches_prefixes(arch, pooler)),
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_offload_gb=self.cpu_offload_gb,
                cache_dtype=validate_kv_cache_dtype(self.kv_cache_dtype, dtype),
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                async_scheduling=(
                    platform.async_scheduling_default
                    if self.async_scheduling is None
                    else self.async_scheduling
                ),
                scheduling_policy=self.scheduling_policy,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                whole_prompts=whole_prompts,
                long_prefill_token_threshold=self._long_prefill_token_threshold(whole_prompts),
                stream_interval=self._stream_interval(),
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size,
            ),
            platform=platform.name,
            attention_backend=self.attention_backend,
            parallel=self._parallel_config(arch, platform),
            structured_outputs_backend=grammar_backend,
            structured_outputs_compact_json=compact_json,
            kv_events=KVEventsConfig.parse(self.kv_events_config),
            kv_transfer=KVTransferConfig.parse(
                offloading_transfer_config(
                    self.kv_offloading_size, self.kv_offloading_backend, self.kv_transfer_config
                )
            ),
            lora=self._lora_config(arch),
            batch_invariant=self.batch_invariant or batch_invariant_from_env(),
            multimodal=multimodal_config(self),
            compilation=resolve_compilation(
                self.compilation_config,
                self.optimization_level,
                self.enforce_eager,
                capture_sizes=self.cudagraph_capture_sizes,
                max_capture_size=self.max_cudagraph_capture_size,
            ),
        )
        config = replace(
            config,
            speculative=parse_speculative_config(
                self.speculative_config,
                config.model,
                max_num_batched_tokens,
                lambda what, name, revision: resolve_model_path(
                    what,
                    name,
                    revision,
                    load_format="dummy" if self.load_format == "dummy" else "auto",
                    token=self.hf_token,
                ),
            ),
        )
        config = replace(
            config,
            structured_outputs_reasoning=reasoning_markers(
                self.structured_outputs_config, config.model, log=log_defaults
            ),
        )
        if config.speculative is not None and config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config is not supported with pipeline_parallel_size > 1 (a "
                "verification's accepted counts would have to reach every stage); drop one "
                "of them."
            )
        check_prompt_embeds_config(config)
        check_kv_transfer_config(config)
        check_transformers_backend(config, model.endswith(".gguf"))
        config = replace(config, logits_processors=self._logits_processors(config))
        config = configure(config, platform)
        platform.bind_config(config)
        return config, platform

    def _logits_processors(self, config: EngineConfig) -> tuple[type, ...]:
        from pagedlm.sample.logits_processor import load_logits_processors

        classes = load_logits_processors(self.logits_processors or ())
        if not classes:
            return ()
        names = ", ".join(cls.__qualname__ for cls in classes)
        if config.model.runner == "pooling":
            raise ValueError(
                f"logits_processors ({names}) need a generating model; runner='pooling' "
                "samples nothing. Drop logits_processors."
            )
        if config.speculative is not None:
            raise ValueError(
                f"logits_processors ({names}) do not combine with speculative_config "
                "(processors see one row per request); drop one of them."
            )
        return classes

    def _runner(self, arch: ArchConfig, model: str) -> tuple[str, PoolerConfig | None]:
        from pagedlm.pooling.model_config import (
            pooler_config,
            resolve_runner,
            with_pooler_overrides,
        )

        runner = resolve_runner(self.runner, arch, model)
        if runner != "pooling":
            if self.pooler_config:
                raise ValueError(
                    f"pooler_config applies to pooling models, but {arch.architecture} runs "
                    "with runner='generate'; drop it, or pass runner='pooling' to embed."
                )
            return runner, None
        for name, value, off in (
            ("speculative_config", self.speculative_config, None),
            ("pipeline_parallel_size", self.pipeline_parallel_size, 1),
        ):
            if value != off:
                raise ValueError(
                    f"runner='pooling' does not support {name}={value!r} (a pooling step "
                    f"ends every request it runs); drop {name}."
                )
        return runner, with_pooler_overrides(
            pooler_config(arch, model), self.pooler_config, arch.hidden_size
        )

    def _whole_prompt_budget(self, max_model_len: int, default: int, why: str) -> int:
        """Whole prompts (the pooling runner, or chunked prefill off): the longest must fit
        one step's budget."""
        budget = self.max_num_batched_tokens
        if budget is not None and budget < max_model_len:
            raise ValueError(
                f"{why} runs each prompt in one step, so max_num_batched_tokens="
                f"{budget} must be at least max_model_len={max_model_len}; raise "
                "--max-num-batched-tokens or lower --max-model-len."
            )
        return budget or max(default, self.max_num_seqs, max_model_len)

    def _parallel_config(self, arch: ArchConfig, platform: Platform) -> ParallelConfig:
        from pagedlm.distributed import setup_checks

        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = setup_checks.resolve_executor_backend(
            self.distributed_executor_backend, world_size, self.data_parallel_size, platform
        )
        setup_checks.check_worker_transport(backend)
        if backend == "ray":
            setup_checks.import_ray()
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            data_parallel_rank=self.data_parallel_rank,
            enable_expert_parallel=self.enable_expert_parallel,
            distributed_executor_backend=backend,
            worker_extension_cls=self._worker_extension(backend),
        )
        setup_checks.check_model_fits(arch, parallel)
        setup_checks.check_devices(parallel, platform)
        setup_checks.check_dist_backend(parallel, platform)
        return parallel

    def _worker_extension(self, backend: str) -> str | None:
        name = self.worker_extension_cls
        if not name:
            return None
        from pagedlm.worker.extension import FLAG, load_worker_extension

        extension = load_worker_extension(name)
        if backend != "uni" and extension.__module__ == "__main__":
            raise ValueError(
                f"{FLAG} {name!r} is defined in __main__, which the worker processes of "
                f"distributed_executor_backend={backend!r} cannot import; move the class to "
                "a module."
            )
        return name

    def _num_kv_blocks(self) -> int | None:
        """``num_kv_blocks``, or vLLM's ``num_gpu_blocks_override`` for it."""
        ours, vllms = self.num_kv_blocks, self.num_gpu_blocks_override
        if ours is not None and vllms is not None and ours != vllms:
            raise ValueError(
                f"num_kv_blocks={ours} and num_gpu_blocks_override={vllms} disagree; they "
                "are one setting (vLLM's name and pagedlm's): give one of them."
            )
        return ours if ours is not None else vllms

    def _check_operability_limits(self) -> None:
        for name in ("structured_outputs_max_spec_chars", "structured_outputs_compile_timeout_s"):
            value = getattr(self, name)
            if not value >= 0:  # NaN fails too
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name}={value} must be >= 0 (0: no limit); fix {flag}.")
        for name, least in (
            ("engine_iteration_timeout_s", 0.0),
            ("engine_heartbeat_timeout_s", 1.0),
        ):
            value = getattr(self, name)
            if not least < value < float("inf"):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{name}={value} must be a number of seconds above {least:g} (heartbeats "
                    f"come every 0.5 s); fix {flag}."
                )

    def _lora_config(self, arch: ArchConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        from pagedlm.lora.targets import check_lora_architecture

        check_lora_architecture(arch)
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )

    def _check_loading_options(self) -> None:
        from pagedlm.model_executor.loader import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is unknown; use one of "
                f"{', '.join(LOAD_FORMATS)}."
            )
        check_quantization_name(self.quantization, self.bnb_quant_type)

    def _check_weight_files(self, model: str) -> None:
        """Fails early when ``load_format`` does not fit the file type (before parsing it)."""
        is_gguf = model.endswith(".gguf")
        if self.load_format == "gguf" and not is_gguf:
            raise ValueError(f"load_format='gguf' needs a .gguf file, but {model} is a directory.")
        if self.load_format in ("safetensors", "pt") and is_gguf:
            raise ValueError(
                f"load_format={self.load_format!r} needs a model directory, but {model} is a "
                ".gguf file; use load_format='auto' or 'gguf'."
            )

    def _check_checkpoint_files(self, model: str, arch: ArchConfig) -> None:
        """The directory has weights in the format asked for, and readable by its loader."""
        from pagedlm.model_executor.loader.weight_files import checkpoint_files

        files = checkpoint_files(model, self.load_format)
        if files.format == "pt" and "quantization_config" in arch.raw:
            raise ValueError(
                f"{model} is a pre-quantized checkpoint in PyTorch .bin/.pt files; pagedlm "
                "reads pre-quantized checkpoints from safetensors only. Convert it (load it "
                "with transformers, then save_pretrained(dir)) and load that directory."
            )

    def _long_prefill_token_threshold(self, whole_prompts: bool) -> int:
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be a non-negative integer (0: no cap), "
                f"got {threshold!r}."
            )
        if threshold and whole_prompts:
            raise ValueError(
                f"long_prefill_token_threshold={threshold} splits prompts over steps, but "
                "prompts run whole here (chunked prefill off, or a pooling model); drop it."
            )
        return threshold

    def _stream_interval(self) -> int:
        value = self.stream_interval
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stream_interval must be an integer >= 1 (tokens), got {value!r}.")
        return value

    def _logprobs_mode(self) -> str:
        from pagedlm.sample.logprobs import check_logprobs_mode

        check_logprobs_mode(self.logprobs_mode)
        return self.logprobs_mode

    def _max_logprobs(self, arch: ArchConfig) -> int:
        value = self.max_logprobs
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(
                f"max_logprobs must be -1 (the whole vocabulary) or at least 0, got {value!r}."
            )
        return arch.vocab_size if value == -1 else value

    def _max_model_len(self, arch: ArchConfig) -> int:
        from pagedlm.model_executor.layers.rope_frequencies import rope_context_length

        limit = rope_context_length(arch.max_position_embeddings, arch.rope_scaling)
        capped = self.disable_sliding_window and arch.sliding_window is not None
        if capped:
            limit = min(limit, arch.sliding_window)
        if self.max_model_len is None:
            max_model_len = limit
        elif self.max_model_len > limit:
            why = " with disable_sliding_window, the sliding window" if capped else ""
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length"
                f"{why} ({limit} positions); lower max_model_len to at most {limit}."
            )
        else:
            max_model_len = self.max_model_len
        return max_model_len


def _caches_prefixes(arch: ArchConfig, pooler: PoolerConfig) -> bool:
    from pagedlm.pooling.model_config import caches_prefixes

    return caches_prefixes(arch, pooler)


def _chunks_prompts(arch: ArchConfig, pooler: PoolerConfig | None, budget: int | None) -> bool:
    from pagedlm.pooling.model_config import chunks_prompts

    assert pooler is not None, "a pooling runner has a pooler config"
    return chunks_prompts(arch, pooler, budget)


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` in it, nested objects merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged
