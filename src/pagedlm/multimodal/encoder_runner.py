"""The worker's side of multimodal steps: the encoder cache and the step's embeddings.

Per step, in ``execute_model`` order: ``update`` applies the scheduler's changes (new
requests' features, finished requests, the encoder-cache entries to free); then, if the
step feeds any image placeholder (``feeds_images``: such a step runs eager, never from a
graph), ``step_embeddings`` encodes the step's ``scheduled_encoder_inputs`` into the cache
and returns the step's token embeddings with every fed placeholder replaced by its image's
row. The cache is keyed by the images' identifiers, so what chunked prefill, preemption
or another request with the same image needs again is not encoded again; the scheduler's
``EncoderCacheTracker`` decides what it holds.

``bidirectional_spans`` names the positions of the step's bidirectional images (Gemma 3)
for the attention backend, which must support them (checked when the runner is made).

``NullEncoderRunner`` stands in for text-only models (every step is text).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention import AttentionBackend, BatchLayout
from pagedlm.multimodal.tensors import from_tensor_data
from pagedlm.step import SchedulerOutput
from pagedlm.step.multimodal import MultiModalFeature


class NullEncoderRunner:
    def update(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def feeds_images(self, scheduler_output: SchedulerOutput) -> bool:
        return False


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.cache: dict[str, torch.Tensor] = {}
        """identifier -> the image's embedding rows [length, hidden] on the device."""
        self.num_encoded = 0
        """Images encoded so far (tests read it: a cached image is never encoded again)."""
        self.num_encoder_calls = 0
        """``embed_multimodal`` calls so far (tests read it: how images were grouped)."""

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.cache.pop(identifier, None)
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.features.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.mm_features:
                self.features[new.req_id] = new.mm_features

    def _overlaps(self, scheduler_output: SchedulerOutput):
        """(batch row, start, end, feature) for every fed placeholder range of the step."""
        scheduled = scheduler_output.num_scheduled_tokens
        for row, (req_id, start) in enumerate(
            zip(scheduler_output.req_ids, scheduler_output.num_computed_tokens, strict=True)
        ):
            features = self.features.get(req_id)
            if not features:
                continue
            end = start + scheduled[req_id]
            for feature in features:
                if feature.offset < end and feature.end > start:
                    yield row, start, end, feature

    def feeds_images(self, scheduler_output: SchedulerOutput) -> bool:
        return bool(self.features) and any(True for _ in self._overlaps(scheduler_output))

    def _encode(self, features: list[MultiModalFeature]) -> None:
        """Encode ``features`` into the cache: one encoder call per group of images whose
        tensors have the same names and shapes (stacked along their first dimension); for
        a model with ``packed_multimodal_inputs`` (Qwen2.5-VL: patches of every image one
        after another, with their grids), only the shapes after the first must agree. The
        names in the model's ``host_multimodal_inputs`` stay in host memory (what the
        encoder reads on the host, such as Qwen2.5-VL's grids: a copy to the device and
        back would wait for the step in flight)."""
        first = 1 if getattr(self.model, "packed_multimodal_inputs", False) else 0
        groups: dict[tuple, list[MultiModalFeature]] = {}
        for feature in features:
            key = tuple(
                sorted((n, tuple(t.shape[first:]), t.dtype) for n, t in feature.tensors.items())
            )
            groups.setdefault(key, []).append(feature)
        on_host = getattr(self.model, "host_multimodal_inputs", frozenset())
        for group in groups.values():
            tensors = {
                name: torch.cat(
                    [
                        from_tensor_data(f.tensors[name], "cpu" if name in on_host else self.device)
                        for f in group
                    ]
                )
                for name in group[0].tensors
            }
            rows = self.model.embed_multimodal(tensors)
            self.num_encoder_calls += 1
            if rows.shape[0] != sum(f.length for f in group):
                raise RuntimeError(
                    f"the vision encoder produced {rows.shape[0]} rows for images with "
                    f"{sum(f.length for f in group)} placeholder tokens; the processor and "
                    "the model disagree"
                )
            for feature, image_rows in zip(group, rows.split([f.length for f in group])):
                self.cache[feature.identifier] = image_rows
            self.num_encoded += len(group)

    def bidirectional_spans(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[tuple[int, int, int], ...]:
        """(batch row, offset, end) of every bidirectional image the step feeds."""
        return tuple(
            (row, feature.offset, feature.end)
            for row, _, _, feature in self._overlaps(scheduler_output)
            if feature.bidirectional
        )

    def step_embeddings(
        self, scheduler_output: SchedulerOutput, input_ids: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """[num_tokens, hidden]: ``input_ids``' embeddings, image rows at placeholders."""
        to_encode: dict[str, MultiModalFeature] = {}
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = self.features[req_id][index]
                if feature.identifier not in self.cache:
                    to_encode.setdefault(feature.identifier, feature)
        if to_encode:
            self._encode(list(to_encode.values()))
        embeds = self.model.embed_input_ids(input_ids)
        query_start = layout.query_start_loc_cpu
        for row, start, end, feature in self._overlaps(scheduler_output):
            rows = self.cache.get(feature.identifier)
            if rows is None:
                raise RuntimeError(
                    f"image {feature.identifier[:12]} is neither cached nor scheduled for "
                    "encoding; the scheduler's encoder cache and the worker's disagree"
                )
            lo, hi = max(start, feature.offset), min(end, feature.end)
            at = int(query_start[row]) + lo - start
            embeds[at : at + hi - lo] = rows[lo - feature.offset : hi - feature.offset].to(
                embeds.dtype
            )
        return embeds


def make_encoder_runner(
    model: nn.Module, device: torch.device, attn_backend_cls: type[AttentionBackend]
) -> EncoderRunner | NullEncoderRunner:
    if not getattr(model, "supports_multimodal", False):
        return NullEncoderRunner()
    if getattr(model, "bidirectional_images", False) and not getattr(
        attn_backend_cls, "supports_bidirectional_spans", False
    ):
        raise ValueError(
            f"{type(model).__name__} lets an image's tokens attend to each other both ways, "
            f"which the {attn_backend_cls.name!r} attention backend does not implement; "
            "choose one that does (attention_backend='cpu_sdpa')."
        )
    return EncoderRunner(model, device)
