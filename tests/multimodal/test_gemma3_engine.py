"""Gemma 3 with images through the engine: greedy tokens equal transformers' ``generate``
(fp32, CPU), with image tokens attending to each other both ways; images are never split
across prefill chunks; backends without bidirectional spans are refused."""

from __future__ import annotations

import pytest
from tiny_gemma3 import BOI, IMAGE_TOKENS, save_tiny_gemma3
from tiny_llava import hf_greedy, hf_processor, random_image

from pagedlm import LLM, SamplingParams

NEW_TOKENS = 6
TURN = "<start_of_turn>user\n{}describe the picture.<end_of_turn>\n<start_of_turn>model\n"
PROMPTS = [
    (TURN.format(BOI), [random_image(40, 50, 1)]),
    (TURN.format(f"a cat {BOI} and {BOI} "), [random_image(64, 32, 2), random_image(33, 33, 3)]),
    (TURN.format("hello. "), []),  # text only, in the same batch
]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3")
    return path, save_tiny_gemma3(path)


@pytest.fixture(scope="module")
def expected(tiny_gemma3):
    path, model = tiny_gemma3
    return [hf_greedy(model, path, text, images, NEW_TOKENS) for text, images in PROMPTS]


def _generate(path, prompts, **kwargs) -> list:
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=8, **kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    inputs = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    return llm, llm.generate(inputs, params, use_tqdm=False)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"num_kv_blocks": 64},
        # Chunks of at most 6 tokens: each 4-token image must start a chunk of its own
        # (a chunk reaching into one stops before it), never be cut in two.
        {"num_kv_blocks": 64, "max_num_batched_tokens": 6},
        {"num_kv_blocks": 64, "max_num_batched_tokens": 7, "async_scheduling": True},
    ],
    ids=["one-step-prefill", "chunked", "chunked-async"],
)
def test_greedy_matches_transformers(tiny_gemma3, expected, engine_kwargs):
    _, outputs = _generate(tiny_gemma3[0], PROMPTS, **engine_kwargs)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_prefix_hit_and_other_image(tiny_gemma3, expected):
    path = tiny_gemma3[0]
    llm, first = _generate(path, PROMPTS[:1], num_kv_blocks=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    text, images = PROMPTS[0]
    token_ids = list(hf_processor(path)(text=text, images=images)["input_ids"][0])
    image_start = token_ids.index(int(llm.llm_engine.config.model.arch.raw["image_token_index"]))
    other = {"prompt": text, "multi_modal_data": {"image": [random_image(40, 50, 9)]}}
    again = {"prompt": text, "multi_modal_data": {"image": images}}
    b, c = llm.generate([other, again], params, use_tqdm=False)
    assert b.num_cached_tokens <= image_start  # the same text, another image: no hit on it
    assert b.outputs[0].token_ids != first[0].outputs[0].token_ids
    assert c.num_cached_tokens > image_start + IMAGE_TOKENS  # the same image hits
    assert list(c.outputs[0].token_ids) == expected[0]


def test_an_image_longer_than_a_step_is_refused(tiny_gemma3):
    llm = LLM(str(tiny_gemma3[0]), dtype="float32", max_model_len=256, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match=f"takes {IMAGE_TOKENS} tokens.*max_num_batched_tokens"):
        llm.generate({"prompt": BOI, "multi_modal_data": {"image": PROMPTS[0][1]}}, use_tqdm=False)
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs


def test_backend_without_bidirectional_spans_is_refused(tiny_gemma3):
    import torch

    from pagedlm.multimodal.encoder_runner import make_encoder_runner
    from pagedlm_cpu.attention import CpuSdpaBackend

    class CausalOnly(CpuSdpaBackend):
        name = "causal_only"
        supports_bidirectional_spans = False

    model = torch.nn.Module()
    model.supports_multimodal = True
    model.bidirectional_images = True
    with pytest.raises(ValueError, match="'causal_only' attention backend does not implement"):
        make_encoder_runner(model, torch.device("cpu"), CausalOnly)
    assert make_encoder_runner(model, torch.device("cpu"), CpuSdpaBackend) is not None


def test_chat_with_an_image_part(tiny_gemma3):
    path, model = tiny_gemma3
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=32)
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
    assert list(out.outputs[0].token_ids) == hf_greedy(
        model, path, TURN.format(BOI), [image], NEW_TOKENS
    )
