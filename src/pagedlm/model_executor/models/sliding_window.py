"""Which decoder layers attend over a sliding window, from the config's spelling of it."""

from __future__ import annotations

from pagedlm.config import ArchConfig


def layer_sliding_windows(arch: ArchConfig) -> list[int | None]:
    """[num_hidden_layers] each layer's window (None: full attention).

    Configs say it two ways: ``layer_types`` lists ``"sliding_attention"`` or
    ``"full_attention"`` per layer (Gemma 2/3, Qwen2/3 with ``use_sliding_window``), or a
    bare ``sliding_window`` applies to every layer (Mistral, Mixtral, Phi-3).
    ``arch.sliding_window`` is already None when ``use_sliding_window`` is false.
    """
    window = arch.sliding_window
    layer_types = arch.raw.get("layer_types")
    if window is None:
        return [None] * arch.num_hidden_layers
    if not layer_types:
        return [window] * arch.num_hidden_layers
    if len(layer_types) != arch.num_hidden_layers:
        raise ValueError(
            f"config.json lists {len(layer_types)} layer_types for {arch.num_hidden_layers} "
            "layers; fix layer_types or num_hidden_layers."
        )
    return [window if kind == "sliding_attention" else None for kind in layer_types]
