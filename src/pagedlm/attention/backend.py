"""The attention backend interface.

A step's batch is flattened: all scheduled tokens of all requests concatenated. Request
``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those rows are the
tokens at positions ``context_lens[i] .. seq_lens[i]-1`` of its sequence, and its K/V for
positions ``0 .. seq_lens[i]-1`` are read from the blocks in ``block_table[i]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class BatchLayout:
    """The shape of one step's flattened batch, built once per step by the model runner.

    The tensors are int32 on the platform's device, views of the runner's persistent step
    buffers (under a CUDA graph, the same memory at every replay); the ``*_cpu`` arrays
    are host copies of the same values, for backends that plan on the host.

    Invariants:
    - ``query_start_loc[0] == 0``, ``query_start_loc[num_reqs] == num_tokens``.
    - ``block_table[i, j]`` is the ``j``-th block of request ``i`` for every
      ``j < ceil(seq_lens[i] / block_size)``; entries past that hold some valid block id
      whose contents must not be read.
    - ``slot_mapping[t] = block * block_size + offset`` is where token ``t``'s K/V go;
      ``-1`` (a padding row of a captured graph) writes nothing. Padding rows have
      ``seq_lens`` 0 and attend to nothing; their outputs are never read. They occur only
      in steps replayed from a captured graph, so only for query lengths the backend's
      ``supports_graph`` accepts.
    - ``max_query_len``/``max_seq_len`` bound the query and sequence lengths (under a
      graph, the captured query length and ``max_model_len``).
    """

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor
    """[num_reqs + 1] offsets into the flattened tokens."""
    seq_lens: torch.Tensor
    """[num_reqs] context length after this step (computed before + scheduled now)."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks_per_req] block ids."""
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot of every scheduled token."""
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    bidirectional_spans: tuple[tuple[int, int, int], ...] = ()
    """(request row, start, end): the request's positions ``start .. end-1`` (one image of
    a model whose image tokens attend to each other both ways, Gemma 3) also see each
    other's keys, later ones included. Only in eager steps that feed such an image; every
    position of a span is either cached context or in the step (the scheduler never
    splits one). Backends read it only if ``supports_bidirectional_spans``."""

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    @property
    def context_lens_cpu(self) -> np.ndarray:
        return self.seq_lens_cpu - self.query_lens_cpu

    @classmethod
    def from_lists(
        cls,
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> BatchLayout:
        """A layout from host lists (tests, the profiling run): block tables padded with 0."""
        width = max((len(table) for table in block_tables), default=0) or 1
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        qsl = np.asarray(query_start_loc, dtype=np.int32)
        lens = np.asarray(seq_lens, dtype=np.int32)

        def on_device(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device)

        return cls(
            num_reqs=len(lens),
            num_tokens=int(qsl[-1]),
            max_query_len=int(np.diff(qsl).max(initial=0)),
            max_seq_len=int(lens.max(initial=0)),
            block_size=block_size,
            query_start_loc=on_device(qsl),
            seq_lens=on_device(lens),
            block_table=on_device(tables),
            slot_mapping=on_device(np.asarray(slot_mapping, dtype=np.int32)),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )


AttentionMetadata = Any
"""Whatever a backend's ``build_metadata`` returns; only that backend reads it."""


class FusedRotary(NamedTuple):
    """A rotary embedding for the backend to apply inside its kernel, to the step's query
    and new keys before it reads or stores them (``AttentionBackend.fuses_rotary``).

    Token ``t`` is rotated by ``positions[t]``: pair ``i`` of a head (the head's halves,
    ``(x[i], x[i + head_dim/2])``, with ``is_neox_style``; else ``(x[2i], x[2i + 1])``)
    by the angle whose cos and sin are ``cos_sin_cache[positions[t], i]`` and
    ``[..., head_dim/2 + i]``, computed in float32 and rounded to the query's dtype.
    ``qk_norm`` = (q_weight [head_dim], k_weight [head_dim], eps): each head of q and k is
    RMS-normalized first (Qwen3), its product with the norm and then with the weight
    each rounded to the query's dtype, as the platform's separate rotary kernel does."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox_style: bool
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


class AttentionBackend(ABC):
    """Computes causal attention over the paged KV cache for one flattened batch.

    Invariants:
    - ``name`` equals the name of the ``BackendSpec`` that registers the class; the model
      runner creates one instance (``cls(device)``) and uses it alone, so ``forward`` need
      not be reentrant.
    - ``build_metadata`` runs once per step, never per layer.
    - ``forward`` first writes the step's new K/V into the cache at ``slot_mapping``, then
      reads. A request may therefore read blocks that another request of the same step
      fills (prefix-cache hits on blocks scheduled in that step rely on this).
    - Query row ``t`` attends to key positions ``<= its own position`` of its request only;
      with a ``sliding_window`` of ``w``, only to the ``w`` positions ``> position - w``;
      with ``causal=False`` (backends with ``supports_non_causal``), to every position
      ``< seq_len`` of its request. With ``supports_bidirectional_spans``, a row inside one
      of the layout's spans also attends to the span's later positions (still within the
      window, if any).

    Optional features a model may ask for per layer (``forward``'s keyword arguments); a
    backend that implements one sets the matching flag, and the attention layer refuses
    to call a backend without it rather than silently attending over the wrong keys.

    Graph hooks: a platform that replays steps from captured graphs asks the backend
    whether a uniform batch (every request ``query_len`` tokens) can be captured
    (``supports_graph``), builds the capture's metadata through ``build_graph_metadata``
    over the runner's static buffers, and calls ``prepare_graph_replay`` before each
    replay with that step's real layout. A backend with no graph support needs none of
    them.
    """

    name: ClassVar[str]
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_fp8_kv_cache: ClassVar[bool] = False
    """Whether ``forward`` takes a float8 E4M3 cache with ``k_scale``/``v_scale``
    (``pagedlm.kv_cache.fp8``): it quantizes the new K/V on write and dequantizes on read."""
    supports_batch_invariant: ClassVar[bool] = False
    """Whether ``set_batch_invariant(True)`` is implemented: every query token's output
    then depends only on its own query and keys, never on the batch or on the chunk it
    was scheduled in (``pagedlm.batch_invariant``)."""
    batch_invariant: bool = False
    supports_non_causal: ClassVar[bool] = False
    """Whether ``forward`` honours ``causal=False`` (bidirectional encoders)."""
    supports_sinks: ClassVar[bool] = False
    """Whether ``forward`` honours ``sinks`` (a learned logit per head in every softmax
    denominator, gpt-oss's attention sinks)."""
    supports_bidirectional_spans: ClassVar[bool] = False
    """Whether ``build_metadata`` honours ``BatchLayout.bidirectional_spans``; the model
    runner refuses to load a model that needs them on a backend without."""
    supports_latent_kv: ClassVar[bool] = False
    """Whether ``forward`` takes ``value_dim`` (latent attention: DeepSeek's MLA over a
    latent cache). Each token then has one key "head" that is also its value: ``value is
    key`` ([num_tokens, 1, head_dim]), ``value_cache is key_cache`` (one tensor per layer,
    written once), and a key's first ``value_dim`` features are its value; the output is
    [num_tokens, num_heads, value_dim]. A model that asks for it on a backend without it
    falls back to attention over expanded keys and values (a larger cache)."""
    reads_host_lengths: ClassVar[bool] = True
    """Whether ``build_metadata`` plans from the layout's host arrays (``*_cpu``). A backend
    that reads only its device tensors, taking ``max_*`` as bounds, sets False: the model
    runner may then correct a step's lengths on the device after the host arrays were
    written (speculative decoding under asynchronous scheduling) instead of waiting."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache tensor, allocated zeroed by
        ``Platform.zeros``. The first dimension is the block id (``TensorKVCache`` reads
        ``num_blocks`` from it) and the tensor holds exactly ``num_blocks * block_size *
        num_kv_heads * head_dim`` elements, as ``kv_bytes_per_block`` counts for KV
        sizing; how a block's slots, heads and dims are laid out is the backend's."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def kv_block_view(
        cls, layer_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """One layer's key (or value) cache as a view ``[num_blocks, block_size,
        num_kv_heads, head_dim]`` (slot ``s`` at ``[s // block_size, s % block_size]``),
        whatever the backend's own layout: KV connectors read and write whole blocks through
        it. The default serves the default ``kv_cache_shape``; a backend that lays its cache
        out otherwise overrides both (it is refused here rather than misread)."""
        if cls.kv_cache_shape is not AttentionBackend.kv_cache_shape:
            raise ValueError(
                f"the {cls.name!r} attention backend has its own KV cache layout and no "
                "kv_block_view, which KV transfer needs; implement it, or drop "
                "kv_transfer_config."
            )
        return layer_cache.view(-1, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Turn the step's layout into whatever ``forward`` needs (device tensors, ...)."""

    def set_batch_invariant(self, enabled: bool) -> None:
        """Switch the batch-invariant mode (before the first step); refused unless the
        backend sets ``supports_batch_invariant``."""
        if enabled and not self.supports_batch_invariant:
            raise ValueError(
                f"the {self.name!r} attention backend has no batch-invariant mode; drop "
                "batch_invariant or choose a backend that has one."
            )
        self.batch_invariant = enabled

    def supports_graph(self, query_len: int) -> bool:
        """Whether steps where every request has ``query_len`` tokens can be captured."""
        return False

    def fuses_rotary(self, metadata: AttentionMetadata | None, head_dim: int) -> bool:
        """Whether ``forward`` takes the step's rotary embedding (``rotary``, a
        ``FusedRotary``) for a step with ``metadata`` (None: a step not known yet, such as
        a recorded piece of a forward) and heads of ``head_dim``, applying it to the query
        and the new keys in its own kernels. Default: no; the attention layer then
        rotates them before calling ``forward``."""
        return False

    def build_graph_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Metadata for capturing ``layout``, whose tensors are static buffers that every
        replay refills: what it returns must read them at replay, never copies made now.
        Default: ``build_metadata``, right for backends whose metadata are views."""
        return self.build_metadata(layout)

    def prepare_graph_replay(  # noqa: B027 - optional hook
        self, metadata: AttentionMetadata, layout: BatchLayout
    ) -> None:
        """Host-side work before replaying a graph captured with ``metadata``; ``layout``
        is the step's (padded) layout, its static buffers already filled. Default: none."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        causal: bool = True,
        rotary: FusedRotary | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        """Attention for every scheduled token.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim]; returns [num_tokens, num_heads, head_dim]. ``num_heads`` is a multiple
        of ``num_kv_heads`` (grouped-query attention).

        ``sliding_window``: None, or ``w`` so that the query at position ``p`` sees keys at
        positions ``p - w + 1 .. p`` only (Mistral, Gemma 2/3 local layers). All positions'
        K/V are still written; which blocks may be freed early is the KV manager's concern.
        ``logits_soft_cap``: None, or ``c`` so that scores become ``c * tanh(scores / c)``
        before the softmax (Gemma 2). ``causal=False``: every query row sees every key
        position ``< seq_len`` of its request (BERT-style encoders). Only passed when set,
        and only to backends whose ``supports_*`` flag says so. ``k_scale``/``v_scale``:
        float32 [1] tensors, passed exactly when the caches are float8
        (``supports_fp8_kv_cache``): the new K/V are stored as ``saturate(k / k_scale)``
        and cached ones read as ``stored * k_scale``. ``rotary``: the query and keys are
        not rotated yet; apply this ``FusedRotary`` first (only passed where
        ``fuses_rotary`` said so for this step). ``sinks``: None, or [num_heads] logits
        (any float dtype) that join each query's softmax as one more term of its
        denominator with no value: head ``h``'s weights become ``exp(s_j) / (exp(sinks[h])
        + sum_j exp(s_j))`` over its visible keys, so they may sum to less than 1
        (gpt-oss). Only passed to backends with ``supports_sinks``. ``value_dim``: None,
        or ``d`` for latent attention (only to backends with ``supports_latent_kv``):
        ``num_kv_heads`` is 1, ``value is key`` and ``value_cache is key_cache``, each
        key's first ``d`` features are its value, and the result is [num_tokens,
        num_heads, d]; with an FP8 cache ``v_scale is k_scale``.
        """
