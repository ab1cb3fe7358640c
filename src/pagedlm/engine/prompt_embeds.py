"""Prompts given as input embeddings (vLLM's ``prompt_embeds``, ``enable_prompt_embeds``).

A prompt ``{"prompt_embeds": tensor [num_tokens, hidden_size]}`` holds the rows the model's
input embedding layer would give for some tokens (transformers' ``get_input_embeddings()``;
a multiplier the model applies after that layer, Gemma's normalizer or Granite's
``embedding_multiplier``, still applies). The engine-core request carries the rows, in the
model's dtype, as ``TensorData``; its prompt token ids are ``num_tokens`` placeholders, so
the scheduler's lengths, KV blocks and chunking work unchanged, and the prefix cache keys
each block by its rows' digest (``kv_cache.hashing``). The workers feed the rows at the
prompt's positions (``worker/prompt_embeds.py``); generated tokens go back in as ids.

Checked here, once, at the edge: the engine's flag, the tensor (2-D after an optional
leading batch dimension of one, floating, dense, the model's hidden size, finite, at most
``max_model_len`` rows once ``truncate_prompt_tokens`` has cut them on the request's
``truncation_side``, as token ids are cut), and the request features that need real
prompt tokens or another input path (prompt logprobs, repetition penalty, images). LoRA
adapters apply to the layers after the embeddings, as in vLLM.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from pagedlm.engine.tokenization_kwargs import truncate_ids
from pagedlm.multimodal.tensors import to_tensor_data
from pagedlm.step.multimodal import TensorData

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, ModelConfig
    from pagedlm.sampling_params import SamplingParams

FLAG = "enable_prompt_embeds=True (--enable-prompt-embeds)"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_prompt_embeds_config(config: EngineConfig) -> None:
    """Start-up: refuse ``enable_prompt_embeds`` beside what cannot take embeddings."""
    if not config.model.enable_prompt_embeds:
        return
    if config.model.runner == "pooling":
        raise ValueError(
            f"{FLAG} applies to generating models; runner='pooling' takes token prompts "
            "only. Drop enable_prompt_embeds."
        )
    if config.speculative is not None:
        raise ValueError(
            f"{FLAG} does not combine with speculative_config (a proposer drafts from "
            "token ids); drop one of them."
        )
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"{FLAG} needs pipeline_parallel_size=1 (the first stage would have to hand "
            "every prompt's rows on); drop one of them."
        )


def embeds_of(prompt: Any) -> Any:
    """The prompt's ``prompt_embeds`` (None: a text or token prompt)."""
    return prompt.get("prompt_embeds") if isinstance(prompt, Mapping) else None


def checked_prompt_embeds(
    prompt: Mapping[str, Any],
    params: SamplingParams,
    model_config: ModelConfig,
    keep: int | None,
    side: str = "left",
) -> TensorData:
    """The prompt's embeddings, checked and in the model's dtype, as the engine carries
    them. ``keep`` rows at most are kept (``truncate_prompt_tokens``), the last ones for
    ``side`` "left" and the first for "right", as token ids are cut; the cut comes before
    the rows are counted against ``max_model_len``, as vLLM's does. ValueError names what
    is wrong."""
    if not model_config.enable_prompt_embeds:
        raise ValueError(
            "This prompt is given as embeddings (prompt_embeds), which needs an engine "
            f"started with {FLAG}."
        )
    other = [key for key in ("prompt", "prompt_token_ids", "multi_modal_data") if key in prompt]
    if other:
        raise ValueError(
            f"A prompt with prompt_embeds cannot also carry {', '.join(other)}; send them "
            "as separate prompts."
        )
    if params.prompt_logprobs is not None:
        raise ValueError(
            "prompt_logprobs need the prompt's token ids, which a prompt given as "
            "embeddings does not have; drop prompt_logprobs."
        )
    if params.repetition_penalty != 1.0:
        raise ValueError(
            "repetition_penalty counts the prompt's tokens, which a prompt given as "
            "embeddings does not have; use presence_penalty or frequency_penalty (they "
            "count the generated tokens only)."
        )
    tensor = _checked_tensor(prompt["prompt_embeds"], model_config, keep, side)
    return to_tensor_data(tensor.to(model_config.dtype))


def _checked_tensor(
    value: Any, model_config: ModelConfig, keep: int | None, side: str
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"prompt_embeds must be a torch.Tensor [num_tokens, hidden_size], got "
            f"{type(value).__name__}."
        )
    if value.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {value.layout}.")
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]  # a batch of one, as transformers' embedding layer returns it
    hidden = model_config.arch.hidden_size
    if value.dim() != 2 or value.shape[1] != hidden:
        raise ValueError(
            f"prompt_embeds must have shape [num_tokens, {hidden}] (this model's hidden "
            f"size), got {list(value.shape)}."
        )
    if value.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"prompt_embeds must be floating point (float32, float16 or bfloat16), got "
            f"{str(value.dtype).removeprefix('torch.')}."
        )
    value = truncate_ids(value, keep, side)
    num_rows, limit = value.shape[0], model_config.max_model_len
    if not 0 < num_rows <= limit:
        raise ValueError(
            f"prompt_embeds has {num_rows} rows; a prompt needs 1 to {limit} "
            "(max_model_len) of them."
        )
    if value.device.type == "meta":
        raise ValueError("prompt_embeds is a meta tensor, which holds no values.")
    # Checked in the model's dtype: a finite float32 value may overflow float16.
    value = value.detach().to("cpu", dtype=model_config.dtype)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(
            f"prompt_embeds holds NaN or infinite values (in the model's dtype, "
            f"{str(model_config.dtype).removeprefix('torch.')})."
        )
    return value


def load_base64_embeds(data: str | bytes) -> torch.Tensor:
    """One tensor from the base64 of ``torch.save``'s bytes (the HTTP form), read with
    ``weights_only=True`` (no code runs); its size is bounded by the server's request body
    limit (``--max-request-body-bytes``). ValueError names what is wrong."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"prompt_embeds is not valid base64: {error}") from None
    if zipfile.is_zipfile(io.BytesIO(raw)):
        # torch.save stores its entries uncompressed: a compressed one could unpack to
        # far more than the request's body-size limit.
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
                raise ValueError(
                    "prompt_embeds holds a compressed archive; send torch.save's bytes as written."
                )
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as error:  # any unreadable payload is the client's
        raise ValueError(
            "prompt_embeds must be the base64 of the bytes torch.save writes for one "
            f"tensor; it could not be loaded ({type(error).__name__})."
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold one torch.Tensor, got {type(tensor).__name__}.")
    # Sizes and strides come from the payload: a few bytes of storage may claim gigabytes
    # of elements (a stride of 0), which the checks would then materialize.
    if tensor.device.type == "meta":
        raise ValueError("prompt_embeds is a meta tensor, which holds no values.")
    stored = tensor.untyped_storage().nbytes()
    if not tensor.is_contiguous() or stored < tensor.numel() * tensor.element_size():
        raise ValueError(
            "prompt_embeds must be a dense, contiguous tensor whose data the payload holds "
            "(torch.save of a plain tensor); this one's strides repeat or skip its storage."
        )
    return tensor
