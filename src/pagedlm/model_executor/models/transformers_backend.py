"""The Transformers modeling backend: a model pagedlm does not implement, run through
transformers' own modeling code with pagedlm's paged attention plugged in (vLLM's
``--model-impl transformers``).

transformers' ``*ForCausalLM`` is built from the config with its parameters on the meta
device (buffers such as rotary tables are computed on the real one), then each parameter
is allocated once, empty, for the loader to fill. The step's flattened batch runs as one
sequence of batch 1 whose ``position_ids`` are the step's positions; every attention
module of the model calls the attention function registered as ``ATTENTION_NAME``, which
hands the already rotated q/k/v to the layer's ``Attention`` over the paged KV cache.
transformers builds no mask for an attention implementation without a registered mask
function: the backend masks by the step's paged metadata (causal, sliding windows).

Its steps are captured in device graphs like a native model's: the forward's Python runs
once per captured shape, its kernels replay. A model whose forward cannot be captured
(one that reads device values on the host, such as dynamic rotary scaling's longest
position) fails the capture at start-up, and the platform's graph runner then runs every
step eagerly.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from pagedlm.config import ArchConfig
from pagedlm.distributed import get_tensor_model_parallel_world_size
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.loader.weight_utils import get_weight_loader
from pagedlm.model_executor.models.transformers_checkpoint import (
    ExpertMerges,
    checkpoint_renames,
    renamed,
)
from pagedlm.model_executor.models.transformers_layers import (
    is_attention_module,
    swap_layers,
    tensor_parallel_refusal,
)

ATTENTION_NAME = "pagedlm"
"""The name pagedlm's attention function is registered under in transformers'
``AttentionInterface`` (and the models' ``config._attn_implementation``)."""


@dataclass(frozen=True)
class _Step:
    ctx: ForwardContext
    layers: nn.ModuleList


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("pagedlm_transformers_step")
"""The step a ``TransformersForCausalLM.forward`` runs: what the attention function reads."""


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pagedlm's paged attention.

    query [1, num_heads, T, head_dim], key/value [1, num_kv_heads, T, head_dim] (rotated
    already) -> ([1, T, num_heads, head_dim], None). ``attention_mask`` is None (no mask
    function is registered for this implementation); the layer's backend masks.
    """
    step = _STEP.get(None)
    if step is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} runs only inside pagedlm's "
            "TransformersForCausalLM.forward (it needs the step's paged KV cache)."
        )
    layer: Attention = step.layers[module.layer_idx]
    _check_call(layer, scaling, kwargs)
    if key.shape[1] != layer.num_kv_heads or query.shape[1] != layer.num_heads:
        raise ValueError(
            f"layer {layer.layer_idx} of transformers' {type(module).__name__} attends with "
            f"{query.shape[1]} query and {key.shape[1]} key/value heads, but the KV cache was "
            f"sized for {layer.num_heads} and {layer.num_kv_heads} from config.json "
            "(num_attention_heads, num_key_value_heads); make config.json say what the model uses."
        )
    num_tokens = query.shape[2]
    q, k, v = (x[0].transpose(0, 1).reshape(num_tokens, -1) for x in (query, key, value))
    out = layer(q, k, v, step.ctx)
    return out.view(1, num_tokens, layer.num_heads, layer.head_dim), None


def _check_call(layer: Attention, scaling: float | None, kwargs: dict[str, Any]) -> None:
    """The module asks for what the layer was built with (scale, window, soft cap)."""
    if scaling is not None and scaling != layer.scale:
        layer.scale = float(scaling)  # the module's own value wins (as in vLLM)
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")  # gpt-oss-style attention sinks: not wired to the backend
    if (
        (window is not None and window != layer.sliding_window)
        or (cap is not None and cap != layer.logits_soft_cap)
        or sinks is not None
    ):
        raise ValueError(
            f"layer {layer.layer_idx} of the Transformers backend was built with "
            f"sliding_window={layer.sliding_window}, logits_soft_cap={layer.logits_soft_cap}, "
            f"but the model's attention asks for sliding_window={window}, softcap={cap}"
            f"{', attention sinks' if sinks is not None else ''}; "
            "this model's attention pattern is not supported by the Transformers backend."
        )


AttentionInterface.register(ATTENTION_NAME, paged_attention)


def hf_config(arch: ArchConfig) -> transformers.PretrainedConfig:
    """transformers' config object of the checkpoint's config.json (``arch.raw``)."""
    model_type = arch.raw.get("model_type")
    if not model_type:
        raise ValueError(
            f"config.json of {arch.architecture} has no model_type, so transformers cannot "
            "build it; add its model_type or use a model pagedlm implements."
        )
    fields = {key: value for key, value in arch.raw.items() if key != "model_type"}
    return AutoConfig.for_model(model_type, **fields)


def hf_head_dim(config: Any) -> int:
    """The head size transformers' attention modules use for ``config``."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (nothing allocated
    or initialized but transiently, one tensor at a time); buffers stay where they are
    made, so computed ones (rotary frequencies) keep their values."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class TransformersForCausalLM(nn.Module):
    """Any transformers ``*ForCausalLM`` whose attention modules call the configured
    attention function (``_supports_attention_backend``), over the paged KV cache.

    ``hf`` is transformers' model with its linear layers, input embedding and LM head
    replaced by pagedlm's (``transformers_layers.swap_layers``: platform kernels, FP8,
    tensor parallelism by the model's plan); checkpoint names load into it unchanged
    (``hf.<name>``), each rank keeping its slices. ``attention[i]`` is decoder layer
    ``i``'s ``Attention``, built from the module's head counts (this rank's), head size,
    scale, sliding window and soft cap.
    """

    lora_module_prefix: ClassVar[str] = "hf."
    """LoRA adapters name transformers' modules, which live under ``hf``."""
    capture_may_fail: ClassVar[bool] = True
    """transformers' forward may wait for the device or branch on device values (dynamic
    rotary scaling reads the longest position): a failed CUDA-graph capture leaves the
    runner eager instead of failing start-up."""
    supports_prompt_embeds: ClassVar[bool] = True
    """Prompts given as embeddings: the rows transformers' ``get_input_embeddings()``
    gives, which its model takes as ``inputs_embeds`` (``enable_prompt_embeds``)."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        config = hf_config(arch)
        config._attn_implementation = ATTENTION_NAME
        dtype = torch.get_default_dtype()
        with _parameters_on_meta():
            self.hf = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=ATTENTION_NAME
            )
        self.config = self.hf.config
        modules = _attention_modules(self.hf)
        if len(modules) != self.config.num_hidden_layers:
            raise ValueError(
                f"{arch.architecture} has {len(modules)} attention modules for "
                f"{self.config.num_hidden_layers} layers: its other layers (recurrent, "
                "convolution, ...) keep state the Transformers backend cannot carry. Serve "
                "it with another engine, or a model whose every layer attends."
            )
        tp_size = get_tensor_model_parallel_world_size()
        refusal = tensor_parallel_refusal(self.hf.base_model, self.config, tp_size)
        if refusal is not None:
            raise ValueError(
                f"{arch.architecture} cannot run with tensor_parallel_size={tp_size} on the "
                f"Transformers backend: {refusal}; run it with tensor_parallel_size=1."
            )
        swap_layers(self.hf, self.config)
        self._materialize()
        self.attention = nn.ModuleList(
            self._attention_layer(i, modules.get(i)) for i in range(self.config.num_hidden_layers)
        )

    def _materialize(self) -> None:
        """Each meta parameter allocated empty on the default device in the dtype
        transformers gave it, shared (tied) parameters staying shared."""
        made: dict[int, nn.Parameter] = {}
        for module in self.hf.modules():
            for name, param in list(module._parameters.items()):
                if param is None or param.device.type != "meta":
                    continue
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype), requires_grad=False
                    )
                module._parameters[name] = made[id(param)]

    def _attention_layer(self, layer_idx: int, module: nn.Module | None) -> Attention:
        config = self.config
        head_dim = int(getattr(module, "head_dim", 0) or hf_head_dim(config))
        if head_dim != self.arch.head_dim:
            raise ValueError(
                f"{self.arch.architecture}'s attention heads have head_dim={head_dim}, but "
                f"the KV cache would be sized for {self.arch.head_dim}; add "
                f'"head_dim": {head_dim} to config.json.'
            )
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        tp_size = get_tensor_model_parallel_world_size()  # the projections split by head
        return Attention(
            layer_idx,
            num_heads // tp_size,
            num_kv_heads // tp_size,
            head_dim,
            float(getattr(module, "scaling", head_dim**-0.5)),
            sliding_window=_layer_window(config, layer_idx),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: object = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size];
        ``inputs_embeds`` [num_tokens, hidden_size] in place of the ids' embeddings."""
        inputs = (
            {"input_ids": input_ids[None]}
            if inputs_embeds is None
            else {"inputs_embeds": inputs_embeds[None]}
        )
        token = _STEP.set(_Step(ctx, self.attention))
        try:
            out = self.hf.base_model(**inputs, position_ids=positions[None], use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden_size]: transformers' input embedding layer."""
        return self.hf.get_input_embeddings()(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden_size] -> [N, vocab], with the config's logit scaling
        and final soft cap as transformers' ``*ForCausalLM`` applies them."""
        logits = self.hf.get_output_embeddings()(hidden_states)
        config = self.config
        if getattr(config, "logit_scale", None) is not None:
            logits = logits * config.logit_scale
        if getattr(config, "logits_scaling", None) is not None:
            logits = logits / config.logits_scaling
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by transformers' own names; returns the parameters filled.
        Names of buffers (old checkpoints' rotary tables), those the model says to ignore
        and a tied LM head are skipped. Tensors transformers merges into one parameter (MoE
        experts saved one by one) are held until the last of them arrives, then merged as
        transformers does (``transformers_checkpoint.ExpertMerges``)."""
        params = dict(self.named_parameters())
        buffers = {name for name, _ in self.hf.named_buffers()}
        ignored = getattr(self.hf, "_keys_to_ignore_on_load_unexpected", None) or []
        loaded: set[str] = set()
        renames = checkpoint_renames(self.hf)
        merges = ExpertMerges(self.hf)
        for saved_name, tensor in weights:
            name = renamed(saved_name, renames)
            merge = merges.target_of(name)
            if merge is not None:
                for merged_name, merged in merges.add(saved_name, merge, tensor).items():
                    target = f"hf.{merged_name}"
                    get_weight_loader(params[target])(params[target], merged)
                    loaded.add(target)
                continue
            target = f"hf.{name}"
            if target not in params:
                if name in buffers or _matches(name, ignored) or name.endswith("lm_head.weight"):
                    continue
                raise ValueError(
                    f"checkpoint tensor {saved_name!r} has no parameter in transformers' "
                    f"{type(self.hf).__name__}; the checkpoint does not match its config.json "
                    "(or was saved by another transformers version with other names)."
                )
            get_weight_loader(params[target])(params[target], tensor)  # this rank's slice
            loaded.add(target)
        merges.finish()
        return loaded


def _attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """transformers' attention modules of ``model`` by their ``layer_idx``."""
    return {m.layer_idx: m for m in model.modules() if is_attention_module(m)}


def _matches(name: str, patterns: list[str]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)


def _layer_window(config: Any, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s sliding window as transformers' config says: per layer in
    ``layer_types``, else for every layer (``use_sliding_window`` unset or true)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window
