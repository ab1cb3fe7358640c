"""``LLM.generate``/``chat`` preprocess a batch's image prompts on a thread pool: the same
tokens as one prompt at a time, results in prompt order, every prompt validated before any
runs (the first bad prompt's error, nothing left queued), arrivals in prompt order; and the
content hash names dtype, shape and tensor names, unchanged by hashing in place."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading

import pytest
import torch

from multimodal.tiny_common import random_image
from multimodal.tiny_qwen2_5_vl import IMAGE, save_tiny_qwen2_5_vl
from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.llm import _arrivals_in_prompt_order
from pagedlm.multimodal.processing import hash_item

TURN = "<|im_start|>user\n{}describe the picture.<|im_end|>\n<|im_start|>assistant\n"
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SIZES = [(90, 130), (200, 60), (33, 33), (64, 64), (150, 100), (40, 120)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    save_tiny_qwen2_5_vl(path)
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=8, num_kv_blocks=96)


def _prompts() -> list:
    prompts: list = [
        {"prompt": TURN.format(IMAGE), "multi_modal_data": {"image": [random_image(w, h, i)]}}
        for i, (w, h) in enumerate(SIZES)
    ]
    prompts.insert(3, TURN.format("hello. "))  # text only, between image prompts
    return prompts


def _threads_used(llm: LLM, monkeypatch) -> set[str]:
    names: set[str] = set()
    engine = llm.llm_engine
    process = engine.process_request

    def recording(*args, **kwargs):
        names.add(threading.current_thread().name)
        return process(*args, **kwargs)

    monkeypatch.setattr(engine, "process_request", recording)
    return names


def test_a_parallel_batch_equals_one_prompt_at_a_time(llm, monkeypatch) -> None:
    prompts = _prompts()
    alone = [llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts]
    threads = _threads_used(llm, monkeypatch)
    batch = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert threads and all(name.startswith("pagedlm-preprocess") for name in threads)
    assert [o.prompt for o in batch] == [o.prompt for o in alone]
    assert [o.prompt_token_ids for o in batch] == [o.prompt_token_ids for o in alone]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


def test_chat_batch_with_images_equals_one_conversation_at_a_time(llm, monkeypatch) -> None:
    def conversation(index: int) -> list[dict]:
        width, height = SIZES[index]
        content = [
            {"type": "image_pil", "image_pil": random_image(width, height, 20 + index)},
            {"type": "text", "text": "describe the picture."},
        ]
        return [{"role": "user", "content": content}]

    conversations = [conversation(i) for i in range(4)]
    conversations.insert(1, [{"role": "user", "content": "hello."}])
    alone = [llm.chat(c, PARAMS, use_tqdm=False)[0] for c in conversations]
    threads = _threads_used(llm, monkeypatch)
    batch = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert threads and all(name.startswith("pagedlm-preprocess") for name in threads), threads
    assert [o.prompt_token_ids for o in batch] == [o.prompt_token_ids for o in alone]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


def test_the_first_bad_prompt_raises_and_nothing_runs(llm) -> None:
    prompts = _prompts()
    # Prompt 2 fails only after its image is processed (too long for max_model_len), prompt
    # 5 at once (no placeholder for its image): the error is prompt 2's, as serially.
    wide = random_image(600, 600, 9)
    prompts[2] = {"prompt": TURN.format(IMAGE * 8), "multi_modal_data": {"image": [wide] * 8}}
    prompts[5] = {"prompt": TURN.format(""), "multi_modal_data": {"image": [wide]}}
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    del prompts[2]
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    del prompts[4]
    assert len(llm.generate(prompts, PARAMS, use_tqdm=False)) == len(prompts)


def test_arrivals_are_restamped_in_prompt_order(llm) -> None:
    engine = llm.llm_engine
    processed = [engine.process_request(f"arrival-{i}", "hello", PARAMS) for i in range(4)]
    shuffled = [
        dataclasses.replace(request, arrival_time=arrival)
        for request, arrival in zip(processed, [5.0, 3.0, 7.0, 6.0])
    ]
    restamped = _arrivals_in_prompt_order(shuffled)
    assert [r.arrival_time for r in restamped] == [5.0, 5.0, 7.0, 7.0]
    assert [r.children[0].arrival_time for r in restamped[1::2]] == [5.0, 7.0]
    assert [r.request_id for r in restamped] == [r.request_id for r in processed]


def _copying_hash(tensors: dict[str, torch.Tensor]) -> str:
    """The digest as it was computed before hashing in place (identifiers must not move)."""
    digest = hashlib.sha256(b"pagedlm-mm-item")
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + b"\0")
        digest.update(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_hash_item_names_dtype_shape_and_names() -> None:
    pixels = torch.randn(6, 8)
    grid = torch.tensor([[1, 2, 3]])
    base = hash_item({"pixel_values": pixels, "image_grid_thw": grid})
    assert base == _copying_hash({"pixel_values": pixels, "image_grid_thw": grid})
    others = [
        {"pixel_values": pixels.view(8, 6), "image_grid_thw": grid},  # same bytes
        {"pixel_values": pixels.view(torch.int32), "image_grid_thw": grid},  # same bytes
        {"pixels": pixels, "image_grid_thw": grid},
        {"pixel_values": pixels, "image_grid_thw": grid + 1},
    ]
    digests = {hash_item(item) for item in others}
    assert len(digests) == len(others) and base not in digests
    # Non-contiguous tensors and dtypes numpy lacks hash by their values.
    assert hash_item({"x": pixels.t()}) == hash_item({"x": pixels.t().contiguous()})
    half = pixels.to(torch.bfloat16)
    assert hash_item({"x": half}) == _copying_hash({"x": half})
    assert hash_item({"x": half}) != hash_item({"x": half.view(torch.int16)})
