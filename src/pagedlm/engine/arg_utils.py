"""Engine arguments, declared once and shared by ``LLM``, the async engine and the CLI.

``EngineArgs.create_engine_config()`` is the edge: it resolves the model, selects the
platform and validates everything, raising ``ValueError`` that names the argument to fix.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlm.config import (
    ArchConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_dtype,
    validate_positive,
)

if TYPE_CHECKING:
    from pagedlm.platforms import Platform

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    model: str | None = None
    """Local HF directory (config.json + safetensors) or .gguf file; None: the embedded
    default model (SmolLM2-135M-Instruct)."""
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool = False
    platform: str | None = None
    attention_backend: str | None = None
    kv_cache_memory_bytes: int | None = None
    trust_remote_code: bool = False
    structured_outputs_backend: str = "xgrammar"
    """Grammar backend for structured outputs: "xgrammar" or "outlines"."""

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def resolve_model(self) -> str:
        if self.model is None:
            from pagedlm.model_executor.loader.default_model import default_model_path

            return default_model_path()
        path = os.path.expanduser(str(self.model))
        if not os.path.exists(path):
            raise ValueError(
                f"Model {self.model!r} not found: pass a local Hugging Face model directory "
                "(config.json + *.safetensors) or a .gguf file, or model=None for the "
                "embedded default model."
            )
        if os.path.isfile(path) and not path.endswith(".gguf"):
            raise ValueError(f"Model file {path!r} is not a .gguf file; pass a directory or .gguf.")
        return path

    def create_engine_config(self) -> tuple[EngineConfig, Platform]:
        from pagedlm.model_executor.models.registry import SUPPORTED_ARCHITECTURES
        from pagedlm.plugins.registry import configure, select_platform

        for name in ("block_size", "max_num_seqs"):
            validate_positive(name, getattr(self, name), allow_none=False)
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_model_len"):
            validate_positive(name, getattr(self, name))

        from pagedlm.structured_output.backend import BACKENDS

        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_backend={self.structured_outputs_backend!r} is unknown; "
                f"use one of {sorted(BACKENDS)}."
            )
        model = self.resolve_model()
        if model.endswith(".gguf"):
            from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config

            arch = gguf_arch_config(model)
        else:
            arch = ArchConfig.from_directory(model)
        if arch.architecture not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ValueError(
                f"Architecture {arch.architecture!r} of {model} is not supported; "
                f"supported architectures: {supported}."
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
            DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs
        )
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=self.tokenizer,
                arch=arch,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                skip_tokenizer_init=self.skip_tokenizer_init,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            platform=platform.name,
            attention_backend=self.attention_backend,
            structured_outputs_backend=self.structured_outputs_backend,
        )
        return configure(config, platform), platform

    def _max_model_len(self, arch: ArchConfig) -> int:
        limit = arch.max_position_embeddings
        if self.max_model_len is None:
            max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length "
                f"({limit} positions); lower max_model_len to at most {limit}."
            )
        else:
            max_model_len = self.max_model_len
        return max_model_len
