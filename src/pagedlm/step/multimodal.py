"""Multimodal items as the step protocol carries them: plain data, no torch.

A prompt's image becomes one ``MultiModalFeature``: where its placeholder tokens sit in
the prompt, the content hash that names it (in the encoder cache and in the prefix
cache's block keys) and the processor's tensors for it, each as bytes + shape + dtype so
msgspec carries them to workers in other processes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorData:
    """One tensor as bytes: ``dtype`` is a torch dtype name ("float32", "bfloat16",
    "int64"), ``shape`` its sizes, ``data`` its contiguous row-major bytes."""

    dtype: str
    shape: list[int]
    data: bytes


@dataclass(frozen=True)
class MultiModalFeature:
    """One item (an image) of a prompt.

    Invariants: the prompt's tokens ``[offset, offset + length)`` are this item's
    placeholders, and the encoder turns ``tensors`` into exactly ``length`` embedding
    rows, scattered there in order. A prompt's features are sorted by ``offset`` and do
    not overlap. ``identifier`` is a hex digest of the item's processed tensors: the same
    identifier means the same embeddings.

    ``bidirectional`` (Gemma 3): the item's placeholder tokens attend to each other both
    ways inside the decoder, so the scheduler never splits them across prefill chunks.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    tensors: dict[str, TensorData] = field(default_factory=dict)
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length
