"""M-RoPE: each prompt's three-part positions equal transformers' ``get_rope_index``; the
rotary equals transformers' for [3, T] positions and plain RoPE for equal parts; the step
builder writes a request's rotary positions (table in the prompt, index + delta after)
while its token and block indices stay token indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.model_executor.layers.rotary_mrope import MRotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope
from pagedlm.multimodal.mrope import MRopePositions, prompt_positions
from pagedlm.multimodal.tensors import to_tensor_data
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import CachedRequestData, NewRequestData, SchedulerOutput
from pagedlm.step.multimodal import MultiModalFeature
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import StepInputBuilder

IMAGE_ID, MERGE = 7, 2


class _RopeIndexHost:
    """What ``Qwen2_5_VLModel.get_rope_index`` reads of ``self`` (no weights built)."""

    def __init__(self, config) -> None:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = config
        self.get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids.__get__(self)


def _hf_rope_index(token_ids: list[int], grids: list[tuple[int, int, int]]):
    """transformers' positions and delta for ``token_ids`` (images: runs of IMAGE_ID)."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": MERGE})
    ids = torch.tensor([token_ids])
    positions, delta = Qwen2_5_VLModel.get_rope_index(
        _RopeIndexHost(config),
        ids,
        mm_token_type_ids=(ids == IMAGE_ID).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    return positions[:, 0].numpy(), int(delta)


@pytest.mark.parametrize(
    "layout",
    [
        [("text", 5), ("image", (1, 2, 3)), ("text", 4)],
        # (in a real prompt <|vision_end|><|vision_start|> separate two images)
        [
            ("image", (1, 4, 2)),
            ("text", 3),
            ("image", (1, 1, 1)),
            ("text", 2),
            ("image", (1, 3, 3)),
        ],
        [("text", 2), ("image", (1, 5, 1))],  # ends on an image
        [("text", 6)],
    ],
)
def test_prompt_positions_match_transformers(layout) -> None:
    token_ids, images, grids = [], [], []
    for kind, value in layout:
        if kind == "text":
            token_ids += [1] * value
        else:
            t, h, w = value
            images.append((len(token_ids), value))
            grids.append((t, h * MERGE, w * MERGE))
            token_ids += [IMAGE_ID] * (t * h * w)
    ours, delta = prompt_positions(len(token_ids), images)
    if not grids:
        assert delta == 0 and (ours == np.arange(len(token_ids))).all()
        return
    expected, expected_delta = _hf_rope_index(token_ids, grids)
    assert ours.tolist() == expected.tolist()
    assert delta == expected_delta


def test_mrope_rotary_matches_transformers_and_plain_rope_on_text() -> None:
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, section = 16, [2, 3, 3]
    config = Qwen2_5_VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    rope = get_rope(head_dim, 64, 10000.0, {"rope_type": "mrope", "mrope_section": section})
    assert isinstance(rope, MRotaryEmbedding)
    torch.manual_seed(0)
    positions = torch.randint(0, 64, (3, 9))
    q, k = torch.randn(9, 4 * head_dim), torch.randn(9, 2 * head_dim)
    ours_q, ours_k = rope(positions, q.clone(), k.clone())
    cos, sin = Qwen2_5_VLRotaryEmbedding(config)(q, positions[:, None, :])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, 9, 4, head_dim).transpose(1, 2),
        k.view(1, 9, 2, head_dim).transpose(1, 2),
        cos,
        sin,
    )
    torch.testing.assert_close(ours_q, ref_q.transpose(1, 2).reshape(9, -1))
    torch.testing.assert_close(ours_k, ref_k.transpose(1, 2).reshape(9, -1))
    # Equal parts: exactly plain RoPE at that position (what [T] positions feed).
    flat = positions[0]
    three_q, _ = rope(flat.expand(3, -1), q.clone(), k.clone())
    plain_q, _ = rope(flat, q.clone(), k.clone())
    torch.testing.assert_close(three_q, plain_q)
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(head_dim, 64, 10000.0, [2, 3, 4])


def _image(offset: int, grid_thw: tuple[int, int, int]) -> MultiModalFeature:
    t, h, w = grid_thw
    return MultiModalFeature(
        "image",
        f"img{offset}",
        offset,
        t * (h // MERGE) * (w // MERGE),
        {"image_grid_thw": to_tensor_data(torch.tensor([grid_thw]))},
    )


def test_step_inputs_feed_rotary_positions_and_keep_token_indices() -> None:
    batch = InputBatch(4, 32, 4, torch.device("cpu"))
    rope = MRopePositions(MERGE, torch.device("cpu"))
    builder = StepInputBuilder(batch, 64, rope_positions=rope)
    # "a": 2 text tokens, a 1x2x3 image (6 tokens, 3 positions), 2 text tokens.
    a_tokens = [1, 2] + [IMAGE_ID] * 6 + [3, 4]
    a = NewRequestData(
        "a", a_tokens, 10, SamplingParams(), [0, 1, 2], 0, mm_features=[_image(2, (1, 4, 6))]
    )
    b = NewRequestData("b", [5, 6, 7], 3, SamplingParams(), [3], 0)  # text only
    output = SchedulerOutput([a, b], CachedRequestData(), {"a": 10, "b": 3}, 13, {}, set(), set())
    batch.update(output)
    rope.update(output)
    step = builder.build(output)
    table, delta = rope.tables["a"]
    assert delta == 7 - 10  # 10 tokens at positions 0..6: the image takes max(2, 3)
    assert step.positions.tolist()[:10] == table[0].tolist()
    assert step.positions.tolist()[10:] == [0, 1, 2]
    row = batch.row_length
    assert step.token_index.tolist() == list(range(10)) + [row, row + 1, row + 2]
    three = rope.step_positions(step.positions, step.req_ids, np.array([0, 0]), np.array([10, 3]))
    assert three[:, :10].tolist() == table.tolist()
    assert three[:, 10:].tolist() == [[0, 1, 2]] * 3
    # Decode: "a"'s 11th token (index 10) sits at position 10 + delta in all three parts.
    batch.token_ids.view(-1).index_put_((step.sample_token_index,), torch.tensor([9, 9]).int())
    output = SchedulerOutput(
        [], CachedRequestData(["a", "b"], [[], []], [10, 3]), {"a": 1, "b": 1}, 2, {}, set(), set()
    )
    batch.update(output)
    step = builder.build(output)
    assert step.positions.tolist() == [10 + delta, 3]
    assert step.layout.slot_mapping.tolist() == [2 * 4 + 2, 3 * 4 + 3]
    # A chunk from inside the prompt to past it (a request resumed with an output).
    flat = rope.text_positions(["a"], np.array([6]), np.array([5]), np.arange(6, 11))
    assert flat.tolist() == table[0, 6:].tolist() + [10 + delta]
    three = rope.step_positions(step.positions, ["a"], np.array([6]), np.array([5]))
    assert three.tolist() == np.concatenate([table[:, 6:], [[10 + delta]] * 3], 1).tolist()
    # Preempted, then admitted again: the table is rebuilt from the prompt.
    rope.update(SchedulerOutput([], CachedRequestData(), {}, 0, {}, set(), {"a"}))
    assert "a" not in rope.tables
