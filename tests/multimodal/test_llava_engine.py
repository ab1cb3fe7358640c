"""LLaVA through the engine: greedy tokens equal transformers' ``generate`` (fp32, CPU)."""

from __future__ import annotations

import pytest
from tiny_llava import IMAGE_TOKENS, hf_greedy, random_image

from pagedlm import LLM, SamplingParams

NEW_TOKENS = 6
TAIL = "describe the picture. ASSISTANT:"
PROMPTS = [
    ("USER: <image>\n" + TAIL, [random_image(40, 50, 1)]),
    ("USER: <image>\n<image>\n" + TAIL, [random_image(64, 32, 2), random_image(33, 33, 3)]),
    (
        "USER: a cat. <image>\nand <image>\nand <image>\n" + TAIL,
        [random_image(20, 90, 4), random_image(50, 50, 5), random_image(128, 96, 6)],
    ),
    ("USER: " + TAIL, []),  # text only, in the same batch
]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=8, **kwargs)


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _generate(llm: LLM, prompts) -> list:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return llm.generate([_prompt(t, i) for t, i in prompts], params, use_tqdm=False)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.fixture(scope="module")
def expected(tiny_llava):
    path, model = tiny_llava
    return [hf_greedy(model, path, text, images, NEW_TOKENS) for text, images in PROMPTS]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # Chunks of 5 tokens: every image spans several chunks (16 tokens each), and
        # the encoder budget (16 rows) pays for one image per step.
        {"max_num_batched_tokens": 5, "max_num_encoder_input_tokens": IMAGE_TOKENS},
        {"max_num_batched_tokens": 7, "async_scheduling": True},
    ],
    ids=["one-step-prefill", "chunked", "chunked-async"],
)
def test_greedy_matches_transformers(tiny_llava, expected, engine_kwargs):
    llm = _llm(tiny_llava[0], **engine_kwargs)
    outputs = _generate(llm, PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # Six distinct images, each encoded once however many chunks read it.
    assert _runner(llm).encoder.num_encoded == 6


def test_preemption_does_not_reencode(tiny_llava, expected):
    # 12 blocks of 8 tokens cannot hold the four requests at once (the three-image
    # prompt alone takes 8): requests are preempted and recomputed.
    llm = _llm(tiny_llava[0], num_kv_blocks=12, enable_prefix_caching=False)
    outputs = _generate(llm, PROMPTS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert _runner(llm).encoder.num_encoded == 6


def test_same_text_other_image_no_prefix_hit(tiny_llava):
    path, model = tiny_llava
    llm = _llm(path)
    text = "USER: <image>\n" + TAIL
    first, second = random_image(40, 40, 10), random_image(40, 40, 11)
    a = _generate(llm, [(text, [first])])[0]
    b = _generate(llm, [(text, [second])])[0]
    again = _generate(llm, [(text, [first])])[0]
    assert b.num_cached_tokens == 0  # the placeholder tokens are the same, the image not
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    assert list(b.outputs[0].token_ids) == hf_greedy(model, path, text, [second], NEW_TOKENS)
    # The control: the same image again hits the prefix cache, with the same answer.
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == a.outputs[0].token_ids


@pytest.mark.parametrize("reload", ["update_weights", "sleep_level_2"])
def test_images_encoded_again_once_the_workers_rebuild_their_runner(tiny_llava, reload):
    # A weight update and a level-2 sleep build the workers' model runner again, with an
    # empty encoder cache; the scheduler still counted the image as cached, so the next
    # request with it failed ("neither cached nor scheduled for encoding") and the engine
    # died.
    path = tiny_llava[0]
    llm = _llm(path, enable_sleep_mode=True)
    before = _generate(llm, [PROMPTS[0]])[0]
    if reload == "update_weights":
        llm.llm_engine.update_weights_from_disk(str(path))
    else:
        llm.sleep(level=2)
        llm.wake_up()
    after = _generate(llm, [PROMPTS[0]])[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert _runner(llm).encoder.num_encoded == 1  # encoded again, by the new runner


def test_chat_with_image_parts(tiny_llava):
    path, model = tiny_llava
    llm = _llm(path)
    image = random_image(48, 36, 7)
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
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    text = "USER: <image>\ndescribe the picture. ASSISTANT:"
    assert list(out.outputs[0].token_ids) == hf_greedy(model, path, text, [image], NEW_TOKENS)


def test_bad_multimodal_input_is_rejected(tiny_llava):
    llm = _llm(tiny_llava[0], limit_mm_per_prompt={"image": 1})
    image = random_image(32, 32, 1)
    with pytest.raises(ValueError, match="at most 1 are allowed"):
        llm.generate(_prompt("USER: <image><image>", [image, image]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"not a PIL\.Image"):
        llm.generate(_prompt("USER: <image>", ["cat.png"]), use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(_prompt("USER: no placeholder", [image]), use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported modalities"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": []}}, use_tqdm=False)
    # The engine still serves.
    assert _generate(llm, [PROMPTS[0]])[0].outputs[0].token_ids


def test_images_to_a_text_only_model_are_rejected(tmp_path):
    from tiny_checkpoints import save_random_model

    save_random_model(tmp_path, "LlamaConfig", {})
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    image = random_image(32, 32, 1)
    with pytest.raises(ValueError, match="is text-only and takes no images"):
        llm.generate(_prompt("USER: <image>", [image]), use_tqdm=False)
    params = SamplingParams(max_tokens=2)
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs
