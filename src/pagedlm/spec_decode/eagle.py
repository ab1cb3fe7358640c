"""EAGLE-1 and EAGLE-3 heads as proposers (``model_executor/models/eagle.py`` has the heads).

Each step, ``observe`` runs the head over the step's own layout: the row at position ``p``
takes the token now at ``p + 1`` (the next prompt token, an emitted token, or a draft the
step rejected; only rows whose next token was emitted are used) and the target's hidden
state at ``p`` (EAGLE-1: its final normed one; EAGLE-3: ``fc`` over the three layer inputs
that hooks on the target copied into a persistent buffer during its forward). The row of
the position before a request's last emitted token yields its first draft; each further
draft feeds the previous one with the head's own output as the hidden state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedlm.attention.backend import BatchLayout
from pagedlm.config import ModelConfig
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import model_kv_geometry
from pagedlm.model_executor.loader import check_all_loaded, iter_model_weights
from pagedlm.model_executor.models.eagle import Eagle3LlamaHead, EagleLlamaHead
from pagedlm.sample.host_copy import tensor_to_device
from pagedlm.spec_decode.model_drafter import ModelDrafter, TargetParts
from pagedlm.spec_decode.proposer import ProposalRequests, SampledStep
from pagedlm.worker.input_batch import InputBatch


def _target_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"EAGLE heads need a Llama-family target with decoder layers; "
            f"{type(model).__name__} has none. Use method 'ngram' or 'draft_model'."
        )
    return layers


def load_head(method: str, config: ModelConfig, device: torch.device) -> nn.Module:
    """The head of ``config`` on ``device``, weights loaded (random for ``dummy``)."""
    arch = config.arch
    dummy = config.load_format == "dummy"
    weights = {} if dummy else dict(iter_model_weights(config))
    has_embedding = "embed_tokens.weight" in weights
    with torch.device(device):
        if method == "eagle3":
            head: nn.Module = Eagle3LlamaHead(arch, has_embedding, config.max_model_len)
        else:
            fc_bias = "fc.bias" in weights if weights else bool(arch.raw.get("bias", True))
            head = EagleLlamaHead(arch, has_embedding, fc_bias, config.max_model_len)
    head.to(config.dtype)
    if dummy:
        from pagedlm.model_executor.loader.dummy import fill_dummy_weights

        fill_dummy_weights(head, config.seed)
    else:
        with torch.no_grad():
            loaded = head.load_weights(weights.items())  # type: ignore[operator]
        check_all_loaded(head, loaded, config)
    return head.eval()


class EagleProposer(ModelDrafter):
    def __init__(
        self, batch: InputBatch, target: TargetParts, method: str, config: ModelConfig
    ) -> None:
        arch = config.arch
        head = load_head(method, config, batch.device)
        target.platform.prepare_model(head)
        num_layers = arch.num_hidden_layers if method == "eagle" else 1
        geometry = model_kv_geometry(head, arch.num_key_value_heads, arch.head_dim)
        super().__init__(batch, target, num_layers, geometry)
        self.head = head
        self.eagle3 = method == "eagle3"
        layers = _target_layers(target.model)
        embedding = head.embed_tokens
        self.embed = embedding if embedding is not None else target.model.decoder.embed_tokens
        self._output: torch.Tensor | None = None
        hidden_buffer = torch.zeros(
            (batch.max_num_reqs, arch.hidden_size), dtype=target.dtype, device=batch.device
        )
        self._step = _EagleStep(head, self.embed, hidden_buffer)
        if self.eagle3:
            self._capture_aux_hidden(layers, arch.raw, target)

    def weight_modules(self) -> list[nn.Module]:
        return [self.head, self.embed]  # the embedding may be the target's own

    def _capture_aux_hidden(self, layers: nn.ModuleList, raw: dict, target: TargetParts) -> None:
        """Hooks copying the hidden states entering three target layers into ``aux``."""
        num_layers = len(layers)
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        ids = tuple(ids or (2, num_layers // 2, num_layers - 3))  # vLLM's default
        if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
            raise ValueError(
                f"EAGLE-3 reads the hidden states entering target layers {list(ids)}, but the "
                f"target has {num_layers} layers; set eagle_aux_hidden_state_layer_ids in the "
                "head's config.json to three layer indices of the target."
            )
        hidden = self.head.fc.input_size // 3
        self.aux = torch.zeros(
            (target.max_num_tokens, 3 * hidden), dtype=target.dtype, device=self.batch.device
        )
        for column, index in enumerate(ids):
            layers[index].register_forward_pre_hook(self._hook(column, hidden))

    def _hook(self, column: int, hidden: int) -> Callable[[nn.Module, tuple], None]:
        def copy_input(module: nn.Module, args: tuple) -> None:
            _, x, residual, _ = args
            value = x if residual is None else x + residual
            self.aux[: value.shape[0], column * hidden : (column + 1) * hidden] = value

        return copy_input

    def observe(self, step: SampledStep) -> None:
        inputs = step.inputs
        total = inputs.layout.num_tokens
        # The token after each row's position, read where the step's outputs now are.
        next_ids = self.batch.token_ids.view(-1)[inputs.token_index + 1]
        hidden = self.head.combine(self.aux[:total]) if self.eagle3 else step.hidden
        ctx = self.context(inputs.layout)
        self._output = self.head(self.embed(next_ids), hidden, inputs.positions, ctx)

    def _draft(self, output: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.head.draft_token_ids(output)
        return self.target.model.compute_logits(output).argmax(dim=-1)

    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._output is not None, "observe runs before propose"
        device = self.batch.device
        inputs = step.inputs
        index = requests.sampled_index
        request = inputs.sampled[index]
        # The row of the position before the last emitted token: after the non-draft fed
        # tokens, as many rows on as drafts were accepted.
        base = inputs.layout.query_start_loc_cpu[request + 1] - 1 - inputs.num_drafts[request]
        accepted = step.num_emitted[requests.sampled_index_device] - 1
        rows = tensor_to_device(torch.from_numpy(base.astype("int64")), device) + accepted
        output = self._output[rows]
        drafts = torch.zeros((len(index), requests.max_drafts), dtype=torch.int64, device=device)
        drafts[:, 0] = self._draft(output)
        self.decode(requests, drafts, 1, drafts[:, 0], output, -2, self._draft_step)
        return drafts, requests.num_drafts_device

    @property
    def step_module(self) -> nn.Module:
        return self._step

    def _draft_step(
        self, layout: BatchLayout, num_reqs: int, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert hidden is not None
        self._step.hidden[:num_reqs] = hidden
        output = self.forward_step(layout, num_reqs)
        return self._draft(output), output


class _EagleStep(nn.Module):
    """One draft forward over persistent buffers: ``hidden`` holds each row's hidden
    input (the head's previous output), filled before the call or the graph's replay."""

    def __init__(self, head: nn.Module, embed: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.embed = embed
        self.hidden = hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        return self.head(self.embed(input_ids), self.hidden[:num_tokens], positions, ctx)
