"""DeepSeek's multi-token-prediction layer as a proposer (vLLM's ``"mtp"`` method).

It drafts as an EAGLE-1 head does (``eagle.py``): each step ``observe`` runs the layer over
the step's rows (the token after each row's position with the target's final normed
hidden state there), the row before a request's last emitted token yields its first
draft, and each further draft feeds the previous one with the layer's own output. The
layer is the checkpoint's own (``model_executor/models/deepseek_mtp.py``, read from the
target's files), its logits the target's LM head over ``shared_head.norm``, its token
embedding the target's. Its KV is latent where the target's is.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pagedlm.config import ModelConfig, SpeculativeConfig
from pagedlm.model_executor.layers.attention import model_kv_geometry
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.models.deepseek_mtp import DeepSeekMTP
from pagedlm.spec_decode.eagle import EagleProposer, _EagleStep
from pagedlm.spec_decode.model_drafter import ModelDrafter, TargetParts
from pagedlm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def mtp_config(target: ModelConfig) -> ModelConfig:
    """What the layer is loaded from: the target's checkpoint as the target was last loaded
    (a weight update from disk moves both, unless the new checkpoint has no such layer:
    ``after_update_from_disk``; one from tensors moves the layer when they include it)."""
    return replace(target, tokenizer=None, skip_tokenizer_init=True)


def _holds_layer(model: ModelConfig) -> bool:
    """Whether ``model``'s safetensors files hold the MTP layer (True where that cannot be
    read from headers: loading then says)."""
    from pagedlm.model_executor.loader.safetensors_loader import safetensors_shapes

    try:
        names = safetensors_shapes(model.model)
    except (OSError, ValueError):
        return True
    select = DeepSeekMTP.checkpoint_selector(model.arch)
    return not names or any(map(select, names))


def after_update_from_disk(
    config: SpeculativeConfig, previous: ModelConfig, updated: ModelConfig
) -> SpeculativeConfig:
    """The configuration of "mtp" once a weight update from disk moves the target from
    ``previous`` to ``updated``: a checkpoint without the layer (what transformers'
    DeepSeek-V3 saves: its model has no such layer) leaves the proposer the layer it has,
    read from the last checkpoint that held it (``draft_model``), as vLLM keeps its
    drafter's weights when the target's are reloaded. Read from that checkpoint's files:
    a layer given since by a weight update from tensors is not what it keeps."""
    if _holds_layer(updated):
        return replace(config, draft_model=None)
    source = config.draft_model or mtp_config(previous)
    logger.warning(
        "%s has no multi-token-prediction layer (model.layers.%d.*); the MTP proposer reads "
        "its layer from %s again.",
        updated.model,
        updated.arch.num_hidden_layers,
        source.model,
    )
    return replace(config, draft_model=source)


def _layer_tensors(
    config: ModelConfig, target: TargetParts
) -> list[tuple[str, torch.Tensor]] | None:
    """The MTP layer's tensors among those the target was just loaded from (a weight update
    from tensors that carries them), else None: read them from the checkpoint."""
    if target.weights is None:
        return None
    select = DeepSeekMTP.checkpoint_selector(config.arch)
    tensors = [(name, tensor) for name, tensor in target.weights if select(name)]
    return tensors or None


class MTPProposer(EagleProposer):
    def __init__(self, batch: InputBatch, target: TargetParts, config: ModelConfig) -> None:
        arch = config.arch
        head = load_model(
            config, batch.device, model_class=DeepSeekMTP, weights=_layer_tensors(config, target)
        )
        target.platform.prepare_model(head)
        target_geometry = model_kv_geometry(target.model, arch.num_key_value_heads, arch.head_dim)
        if target_geometry.shares_values:
            head.enable_latent_kv()  # type: ignore[operator]
        geometry = model_kv_geometry(head, arch.num_key_value_heads, arch.head_dim)
        ModelDrafter.__init__(self, batch, target, 1, geometry)
        self.head = head
        self.eagle3 = False
        self.embed = target.model.decoder.embed_tokens
        self._output = None
        hidden_buffer = torch.zeros(
            (batch.max_num_reqs, arch.hidden_size), dtype=target.dtype, device=batch.device
        )
        self._step = _EagleStep(head, self.embed, hidden_buffer)

    def weight_modules(self) -> list[torch.nn.Module]:
        return [self.head]  # the embedding and LM head are the target's

    def _draft(self, output: torch.Tensor) -> torch.Tensor:
        return self.target.model.compute_logits(self.head.final_norm(output)).argmax(dim=-1)
