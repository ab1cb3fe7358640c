"""Content parts of chat messages with images (``multimodal.chat``) and ``LLM.chat`` /
``LLM.generate`` on bad image inputs: every mistake is a ``ValueError`` naming the part
(``messages.0.content.1``) and the fix; no part is dropped without a word."""

from __future__ import annotations

import pytest
from PIL import Image
from tiny_llava import IMAGE_TOKENS, random_image

from pagedlm import LLM, SamplingParams
from pagedlm.multimodal.chat import ContentPartError, has_images, split_images

IMAGE = random_image(20, 20, 1)
URL = "data:image/png;base64,iVBORw0KGgo="


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "text", "text": 3}, '"text" to be a string, got int'),
        ({"type": "output_text"}, '"text" to be a string, got NoneType'),  # "text": skipped
        ({"type": "input_audio", "input_audio": {}}, "'input_audio' are not supported"),
        ({"type": "video_url", "video_url": {"url": URL}}, "'video_url' are not supported"),
        ({"type": "foo"}, "unknown content part type 'foo'"),
        (None, r"unknown content part \(a NoneType\)"),
        ({"type": "image_url", "image_url": {"url": None}}, r'needs "image_url": \{"url": str\}'),
        ({"type": "image_pil", "image_pil": URL}, "needs a PIL.Image.Image .* got str"),
    ],
)
def test_a_bad_part_beside_an_image_names_its_place(part, message):
    # Before: the processor's template dropped or printed these without a word.
    with pytest.raises(ContentPartError, match=message) as error:
        split_images(_user({"type": "image_pil", "image_pil": IMAGE}, part))
    assert error.value.where == "messages.0.content.1"
    assert str(error.value).startswith("messages.0.content.1: ")


def test_null_text_parts_are_skipped_and_tool_references_kept():
    """vLLM's reading: a null "text"/"refusal" part is left out, a tool reference is
    handed to the processor's template (both were refused)."""
    image = {"type": "image_pil", "image_pil": IMAGE}
    content = [{"type": "text"}, image, {"type": "refusal", "refusal": None}]
    content.append({"type": "tool_reference", "name": "get_weather"})
    messages, images = split_images(_user(*content))
    assert len(images) == 1
    expected = [{"type": "image"}, {"type": "tool_reference", "name": "get_weather"}]
    assert messages[0]["content"] == expected


def test_input_image_and_string_parts():
    messages, images = split_images(
        _user(
            {"type": "input_image", "image_url": URL},
            {"type": "input_image", "image_url": {"url": URL}},
            "describe them.",
        )
    )
    assert [image.source for image in images] == [URL, URL]
    assert [image.where for image in images] == ["messages.0.content.0", "messages.0.content.1"]
    assert messages[0]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "describe them."},
    ]


def test_places_name_the_request_message():
    with pytest.raises(ContentPartError) as error:
        split_images(
            [{"role": "system", "content": "s"}, *_user({"type": "image_url"})],
            places=["system", "messages.0"],
        )
    assert error.value.where == "messages.0.content.0"


@pytest.mark.parametrize("kind", ["input_image", "image_embeds", "input_audio"])
def test_media_parts_take_the_image_path(kind):
    # The image path refuses what it cannot use; the text path would drop it.
    assert has_images(_user({"type": kind}))


def test_parts_without_a_type_are_read_by_their_key():
    """vLLM reads a part without "type" by its key; they were refused as unknown parts."""
    conversation = _user(
        {"image_url": URL},
        {"type": "input_text", "text": "and"},
        {"image_pil": IMAGE, "text": "ignored"},
        {"type": "refusal", "refusal": "no"},
    )
    assert has_images(_user({"image_url": {"url": URL}}))
    messages, images = split_images(conversation)
    assert [image.source for image in images] == [URL, IMAGE]
    assert messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": "no"},
    ]
    with pytest.raises(ContentPartError, match=r'no "type".*add its "type"') as error:
        split_images(_user({"image_url": URL}, {"text": "x"}))
    assert error.value.where == "messages.0.content.1"


@pytest.fixture(scope="module")
def llm(tiny_llava):
    return LLM(
        str(tiny_llava[0]), dtype="float32", max_model_len=256, num_kv_blocks=32,
        limit_mm_per_prompt={"image": 2},
    )  # fmt: skip


def test_llm_chat_input_image_uses_the_image(llm):
    import base64
    import io

    buffer = io.BytesIO()
    IMAGE.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    chats = [
        _user({"type": part, "image_url": url}, {"type": "text", "text": "hi"})
        for part in ("input_image", "image_url")
    ]
    chats.append(_user({"image_url": url}, {"type": "text", "text": "hi"}))  # no "type"
    by_input_image, by_image_url, untyped = llm.chat(chats, params, use_tqdm=False)
    # Before: input_image went to the text path, whose template dropped it.
    assert len(by_input_image.prompt_token_ids) > IMAGE_TOKENS
    assert by_input_image.prompt_token_ids == by_image_url.prompt_token_ids
    assert by_input_image.outputs[0].token_ids == by_image_url.outputs[0].token_ids
    assert untyped.prompt_token_ids == by_image_url.prompt_token_ids


def test_llm_chat_and_generate_errors_name_the_input(llm):
    with pytest.raises(ValueError, match=r"^messages\.0\.content\.1: the image data URL is not"):
        llm.chat(_user("hi", {"type": "image_url", "image_url": "data:image/png;base64,@"}))
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0: .*'image_embeds'"):
        llm.chat(_user({"type": "image_embeds", "image_embeds": "AAAA"}))
    with pytest.raises(ValueError, match=r"\['image'\]\[0\] is 0x0 pixels"):
        empty = {"image": Image.new("RGB", (0, 0))}
        llm.generate({"prompt": "USER: <image>", "multi_modal_data": empty}, use_tqdm=False)
    params = SamplingParams(max_tokens=2)
    assert llm.chat(_user({"type": "image_pil", "image_pil": IMAGE}), params, use_tqdm=False)


def test_llm_chat_continuing_a_message_without_text_names_the_fix(llm):
    """Offline, an image conversation whose last message has no text got transformers'
    "could not find any text to continue"; an image after the text was lost."""
    image = {"type": "image_pil", "image_pil": IMAGE}
    kwargs = {"add_generation_prompt": False, "continue_final_message": True, "use_tqdm": False}
    for content, match in (
        ([], r"^messages\.1\.content: continue_final_message .* end it with a text part"),
        (["a", image], r"^messages\.1\.content\.1: continue_final_message .* this image"),
    ):
        chat = [*_user(image, "hi"), {"role": "assistant", "content": content}]
        with pytest.raises(ValueError, match=match):
            llm.chat(chat, SamplingParams(max_tokens=1), **kwargs)
