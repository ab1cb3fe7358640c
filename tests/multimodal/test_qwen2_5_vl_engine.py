"""Qwen2.5-VL through the engine: the vision tower equals transformers'; greedy tokens
equal transformers' ``generate`` (fp32, CPU) with 1-3 images of different sizes per
prompt and a text-only request in the batch, in one step, chunked (images cut across
chunks, M-RoPE positions continued across them) and under preemption; decode positions
continue from the prompt's largest position (``rope_deltas``)."""

from __future__ import annotations

import pytest
import torch

from multimodal.tiny_common import hf_greedy, random_image
from multimodal.tiny_qwen2_5_vl import IMAGE, processor, save_tiny_qwen2_5_vl
from pagedlm import LLM, SamplingParams

NEW_TOKENS = 6
TURN = "<|im_start|>user\n{}describe the picture.<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    (TURN.format(IMAGE), [random_image(90, 130, 1)]),
    # 200x60: a 2x7 grid of merged tokens, four windows, the last one narrower.
    (
        TURN.format(f"a cat {IMAGE} and {IMAGE}"),
        [random_image(200, 60, 2), random_image(33, 33, 3)],
    ),
    (
        TURN.format(f"{IMAGE}{IMAGE} then {IMAGE}"),
        [random_image(64, 64, 4), random_image(150, 100, 5), random_image(40, 120, 6)],
    ),
    (TURN.format("hello. "), []),  # text only, in the same batch
]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    return path, save_tiny_qwen2_5_vl(path)


@pytest.fixture(scope="module")
def expected(tiny_qwen):
    path, model = tiny_qwen
    return [
        hf_greedy(model, path, text, images, NEW_TOKENS, processor=processor(path))
        for text, images in PROMPTS
    ]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=8, **kwargs)


def _generate(llm: LLM, prompts) -> list:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    inputs = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_vision_tower_matches_transformers(tiny_qwen) -> None:
    path, model = tiny_qwen
    text, images = PROMPTS[2]
    inputs = processor(path)(text=text, images=images, return_tensors="pt")
    ours = _runner(_llm(path)).model
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        rows = ours.embed_multimodal(
            {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        )
    torch.testing.assert_close(rows, torch.cat(expected.pooler_output), rtol=1e-4, atol=1e-5)
    # Three sizes, at least one spanning several windows.
    assert len({tuple(g) for g in inputs["image_grid_thw"].tolist()}) == 3


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # Chunks of 5 tokens: images span several chunks; the encoder budget (12 rows)
        # pays for about one image per step.
        {"max_num_batched_tokens": 5, "max_num_encoder_input_tokens": 12},
        {"max_num_batched_tokens": 7, "async_scheduling": True},
    ],
    ids=["one-step-prefill", "chunked", "chunked-async"],
)
def test_greedy_matches_transformers(tiny_qwen, expected, engine_kwargs) -> None:
    llm = _llm(tiny_qwen[0], **engine_kwargs)
    outputs = _generate(llm, PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    encoder = _runner(llm).encoder
    assert encoder.num_encoded == 6  # each image once, however many chunks
    if not engine_kwargs:  # one step: six images of five sizes in one packed call
        assert encoder.num_encoder_calls == 1


def test_preemption_recomputes_positions(tiny_qwen, expected) -> None:
    # 10 blocks of 8 tokens cannot hold the four requests at once (37 to 59 tokens each
    # with their outputs): some are preempted and recomputed, their M-RoPE tables rebuilt
    # when they are admitted again.
    llm = _llm(tiny_qwen[0], num_kv_blocks=10, enable_prefix_caching=False)
    outputs = _generate(llm, PROMPTS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_same_text_other_image_no_prefix_hit(tiny_qwen) -> None:
    path, model = tiny_qwen
    llm = _llm(path)
    text = TURN.format(IMAGE)
    first, second = random_image(84, 84, 10), random_image(84, 84, 12)
    a = _generate(llm, [(text, [first])])[0]
    b = _generate(llm, [(text, [second])])[0]
    again = _generate(llm, [(text, [first])])[0]
    assert b.num_cached_tokens == 0  # the same placeholder tokens, another image
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    assert list(b.outputs[0].token_ids) == hf_greedy(
        model, path, text, [second], NEW_TOKENS, processor=processor(path)
    )
    # The control: the same image hits the prefix cache, with the same answer.
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == a.outputs[0].token_ids


def test_chat_with_image_parts(tiny_qwen) -> None:
    path, model = tiny_qwen
    image = random_image(70, 50, 7)
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": image},
                {"type": "text", "text": "describe the picture."},
            ],
        }
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    out = _llm(path).chat(conversation, params, use_tqdm=False)[0]
    text = "<|im_start|>user\n" + IMAGE + "describe the picture.<|im_end|>\n<|im_start|>assistant\n"
    expected = hf_greedy(model, path, text, [image], NEW_TOKENS, processor=processor(path))
    assert list(out.outputs[0].token_ids) == expected


def test_bad_image_input_is_rejected_and_the_engine_serves_on(tiny_qwen) -> None:
    llm = _llm(tiny_qwen[0], limit_mm_per_prompt={"image": 2})
    image = random_image(56, 56, 1)
    three = {"prompt": TURN.format(IMAGE * 3), "multi_modal_data": {"image": [image] * 3}}
    with pytest.raises(ValueError, match="at most 2 are allowed"):
        llm.generate(three, use_tqdm=False)
    missing = {"prompt": TURN.format(""), "multi_modal_data": {"image": [image]}}
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(missing, use_tqdm=False)
    assert _generate(llm, [PROMPTS[0]])[0].outputs[0].token_ids
