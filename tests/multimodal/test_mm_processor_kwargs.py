"""``mm_processor_kwargs`` (tiny Qwen2.5-VL, LLaVA and Gemma 3 checkpoints): the flag and a
prompt's own keys reach the image processor (fewer image tokens under ``max_pixels``,
greedy tokens equal transformers' with the same options), a prompt's keys override the
flag's, and an unknown key, a text-only model, or an option that makes images the model
cannot encode are refused naming the problem while the engine serves on."""

from __future__ import annotations

import argparse
import functools
import json
from types import SimpleNamespace

import pytest

from multimodal.tiny_common import hf_greedy, random_image
from multimodal.tiny_qwen2_5_vl import IMAGE, processor, save_tiny_qwen2_5_vl
from pagedlm import LLM, SamplingParams
from pagedlm.config import MultiModalConfig
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.multimodal.config_args import multimodal_config
from pagedlm.multimodal.inputs import MultiModalInputs
from pagedlm.multimodal.item_geometry import gemma3_rows, llava_rows

NEW_TOKENS = 4
PATCHES = 28 * 28  # pixels per merged token (14-pixel patches, 2x2 merged)
TEXT = "<|im_start|>user\n" + IMAGE + "describe the picture.<|im_end|>\n<|im_start|>assistant\n"
PICTURE = random_image(200, 150, 0)  # 20 merged tokens by default (at most 24)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl_kwargs")
    return path, save_tiny_qwen2_5_vl(path)


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    """An engine started with --mm-processor-kwargs '{"max_pixels": 4 tokens}'."""
    return LLM(
        str(tiny_qwen[0]),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        block_size=8,
        mm_processor_kwargs={"max_pixels": 4 * PATCHES},
    )


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _image_tokens(output, image_token_id: int) -> int:
    return output.prompt_token_ids.count(image_token_id)


def _generate(llm: LLM, **prompt_fields):
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": PICTURE}, **prompt_fields}
    return llm.generate(prompt, PARAMS, use_tqdm=False)[0]


def test_flag_and_prompt_kwargs_reach_the_processor(tiny_qwen, llm) -> None:
    path, model = tiny_qwen
    pad = processor(path).image_token_id
    assert processor(path)(text=TEXT, images=[PICTURE])["input_ids"][0].count(pad) == 20
    # The flag: at most 4 merged tokens; the prompt's own max_pixels wins over it.
    for prompt_fields, tokens, longest_edge in [
        ({}, 2, 4 * PATCHES),
        ({"mm_processor_kwargs": {"max_pixels": 12 * PATCHES}}, 12, 12 * PATCHES),
    ]:
        out = _generate(llm, **prompt_fields)
        assert _image_tokens(out, pad) == tokens
        size = {"shortest_edge": 2 * PATCHES, "longest_edge": longest_edge}
        bounded = functools.partial(processor(path), size=size)
        expected = hf_greedy(model, path, TEXT, [PICTURE], NEW_TOKENS, processor=bounded)
        assert list(out.outputs[0].token_ids) == expected


def test_chat_takes_mm_processor_kwargs(tiny_qwen, llm) -> None:
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": PICTURE},
                {"type": "text", "text": "describe the picture."},
            ],
        }
    ]
    pad = processor(tiny_qwen[0]).image_token_id
    out = llm.chat(conversation, PARAMS, use_tqdm=False)[0]
    assert _image_tokens(out, pad) == 2
    kwargs = {"min_pixels": 16 * PATCHES, "max_pixels": 24 * PATCHES}
    out = llm.chat(conversation, PARAMS, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
    assert _image_tokens(out, pad) >= 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_pixel": 100}, r"mm_processor_kwargs has 'max_pixel', which the model's image "),
        ({"return_tensors": "np"}, "has 'return_tensors'"),
        ({"patch_size": 16}, r"patches of \[1536\] values but the model's vision tower takes 1176"),
        ({"merge_size": 1}, "does not merge into the model's 2x2 groups"),
        ({"size": 7}, "the image processor .* failed with"),
        ([("max_pixels", 1)], "must be an object"),
    ],
    ids=["unknown", "not-settable", "patch-size", "merge-size", "bad-value", "not-a-dict"],
)
def test_bad_prompt_kwargs_are_refused_and_the_engine_serves_on(llm, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        _generate(llm, mm_processor_kwargs=kwargs)
    assert len(_generate(llm).outputs[0].token_ids) == NEW_TOKENS


def test_unknown_flag_key_fails_at_start_up(tiny_qwen) -> None:
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs has 'max_pixel'.*max_pixels"):
        LLM(str(tiny_qwen[0]), dtype="float32", mm_processor_kwargs='{"max_pixel": 100}')


def test_text_only_model_refuses_the_flag_and_the_field() -> None:
    text_only = SimpleNamespace(arch=SimpleNamespace(architecture="LlamaForCausalLM"))
    with pytest.raises(ValueError, match="--mm-processor-kwargs is for vision-language models"):
        MultiModalInputs(text_only, MultiModalConfig(mm_processor_kwargs={"max_pixels": 1}))
    inputs = MultiModalInputs(text_only, MultiModalConfig())
    assert inputs.processor_kwargs(None) == {}
    with pytest.raises(ValueError, match="mm_processor_kwargs is for image prompts"):
        inputs.processor_kwargs({"max_pixels": 1})


def test_flag_parses_as_json() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_cli(parser.parse_args(["--mm-processor-kwargs", '{"max_pixels": 9}']))
    assert multimodal_config(args).mm_processor_kwargs == {"max_pixels": 9}
    for bad in ('{"max_pixels": }', "[1, 2]"):
        args.mm_processor_kwargs = bad
        with pytest.raises(ValueError, match="mm_processor_kwargs"):
            multimodal_config(args)


def test_fixed_size_towers_refuse_other_image_sizes(tiny_llava, tmp_path) -> None:
    """LLaVA's CLIP and Gemma 3's SigLIP take one image size: a crop or size option that
    changes it (which their processors accept) is refused before the encoder."""
    from multimodal.tiny_common import hf_processor
    from multimodal.tiny_gemma3 import save_tiny_gemma3

    save_tiny_gemma3(tmp_path)
    for path, rows, option in [
        (tiny_llava[0], llava_rows, {"crop_size": {"height": 48, "width": 48}}),
        (tmp_path, gemma3_rows, {"size": {"height": 48, "width": 48}}),
    ]:
        raw = json.loads((path / "config.json").read_text())
        hf = hf_processor(path)
        placeholder = "<image>" if rows is llava_rows else "<start_of_image>"
        image = random_image(60, 40, 1)
        default = hf(text=placeholder, images=[image], return_tensors="pt")
        assert rows({"pixel_values": default["pixel_values"]}, raw) > 0
        changed = hf(text=placeholder, images=[image], return_tensors="pt", **option)
        with pytest.raises(ValueError, match=r"takes \[3, 32, 32\] \(vision_config.image_size\)"):
            rows({"pixel_values": changed["pixel_values"]}, raw)
