"""Incremental detokenization equals a full decode, and never streams half a character."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from pagedlm.engine.detokenizer import (
    DetokenizerFactory,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    OffsetIncrementalDetokenizer,
)
from pagedlm.sampling_params import SamplingParams


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Every chunk released, the final flush last."""
    return [detokenizer.decode_next(token_id) for token_id in token_ids] + [detokenizer.flush()]


def make(kind: str, tokenizer, prompt_ids: list[int], skip: bool) -> IncrementalDetokenizer:
    factory = DetokenizerFactory(tokenizer)
    if kind == "fast":
        detokenizer = factory.create(prompt_ids, SamplingParams(skip_special_tokens=skip))
        assert isinstance(detokenizer, FastIncrementalDetokenizer)
        return detokenizer
    # The generic path, forced: decode through the transformers wrapper.
    context = factory._prime_ids(prompt_ids, skip)
    return OffsetIncrementalDetokenizer(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=skip), context
    )


@pytest.mark.parametrize("kind", ["fast", "offset"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(bpe_tokenizer, kind, skip_special_tokens):
    rng = random.Random(0)
    vocab = len(bpe_tokenizer)
    prompts = [[], bpe_tokenizer.encode("Hello 日本"), bpe_tokenizer.encode("<|im_start|>Café")]
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        if trial % 3 == 0:  # make special tokens frequent
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(3))
        prompt = prompts[trial % len(prompts)]
        chunks = stream(make(kind, bpe_tokenizer, prompt, skip_special_tokens), ids)
        expected = bpe_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(chunks) == expected, (ids, prompt)


@pytest.mark.parametrize("kind", ["fast", "offset"])
@pytest.mark.parametrize("encoding", ["bpe", "bytes"])
def test_multibyte_characters_are_never_split(bpe_tokenizer, byte_token_ids, kind, encoding):
    text = "Café déjà 日本語 — 😀🎉👍 🚀 naïve"
    ids = bpe_tokenizer.encode(text) if encoding == "bpe" else byte_token_ids(text)
    assert bpe_tokenizer.decode(ids) == text
    chunks = stream(make(kind, bpe_tokenizer, bpe_tokenizer.encode("Say:"), True), ids)
    assert all("\ufffd" not in chunk for chunk in chunks), chunks
    assert "".join(chunks) == text
    if encoding == "bytes":
        # "😀" is four byte tokens: the first three release nothing.
        emoji_start = text.encode().index("😀".encode())
        assert chunks[emoji_start : emoji_start + 3] == ["", "", ""]
        assert chunks[emoji_start + 3] == "😀"


@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_incomplete_character_at_the_end_is_flushed(bpe_tokenizer, byte_token_ids, kind):
    ids = bpe_tokenizer.encode("ok ") + byte_token_ids("日")[:2]
    detokenizer = make(kind, bpe_tokenizer, [], True)
    released = "".join(detokenizer.decode_next(token_id) for token_id in ids)
    assert released == "ok "
    tail = detokenizer.flush()
    assert released + tail == bpe_tokenizer.decode(ids)
    assert tail.endswith("\ufffd")
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_prompt_ending_inside_a_character_does_not_leak_into_output(
    bpe_tokenizer, byte_token_ids, kind
):
    prompt = bpe_tokenizer.encode("Write") + byte_token_ids("é")[:1]
    output = bpe_tokenizer.encode(" the end")
    chunks = stream(make(kind, bpe_tokenizer, prompt, True), output)
    assert "".join(chunks) == " the end"


def metaspace_tokenizer():
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_first_output_token_is_decoded_in_the_prompts_context(kind):
    # SentencePiece-style decoders drop the leading space of the very first token; after a
    # prompt, the first generated word must keep it.
    tokenizer = metaspace_tokenizer()
    assert tokenizer.decode([2]) == "world"
    chunks = stream(make(kind, tokenizer, [1], True), [2, 3])
    assert "".join(chunks) == " world!"


def test_spaces_between_special_tokens_false_joins_added_tokens():
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("[A]", special=True), AddedToken("[B]", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = [1, 3, 4, 2]
    factory = DetokenizerFactory(tokenizer)
    spaced = factory.create([], SamplingParams(skip_special_tokens=False))
    joined = factory.create(
        [], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    )
    assert "".join(stream(spaced, ids)) == "hello [A] [B] world"
    assert "".join(stream(joined, ids)) == "hello [A][B] world"


def test_decoder_that_rewrites_earlier_text_does_not_fail_the_request():
    # "ab" decodes as "X": the stream's released prefix "a" is contradicted, which makes
    # DecodeStream raise; the detokenizer replays the pending ids on a fresh stream.
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    detokenizer = FastIncrementalDetokenizer(backend, [], skip_special_tokens=False)
    assert "".join(stream(detokenizer, [0, 1, 2, 2])) == "abcc"


def test_ids_outside_the_vocabulary_decode_to_nothing(bpe_tokenizer):
    detokenizer = make("fast", bpe_tokenizer, [], True)
    ids = [*bpe_tokenizer.encode("Hi"), 10**6, -1, *bpe_tokenizer.encode(" there")]
    assert "".join(stream(detokenizer, ids)) == "Hi there"


def test_detokenize_false_builds_no_detokenizer(bpe_tokenizer):
    factory = DetokenizerFactory(bpe_tokenizer)
    assert factory.create([1, 2], SamplingParams(detokenize=False)) is None


def test_bare_tokenizers_tokenizer_is_accepted(bpe_tokenizer):
    factory = DetokenizerFactory(bpe_tokenizer.backend_tokenizer)
    detokenizer = factory.create([], SamplingParams())
    text = "日本語のテキスト。こんにちは世界。"
    assert "".join(stream(detokenizer, bpe_tokenizer.encode(text))) == text


@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_whole_characters_before_an_incomplete_one_are_released_at_once(kind):
    # In this small byte-level BPE most tokens of "こんにちは世界。" end one character and
    # begin the next; the finished characters must not wait for a token that happens to
    # end on a character boundary.
    from offline_tokenizers import byte_level_bpe

    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("こんにちは世界。")
    prefixes = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    assert prefixes[0] == "こ\ufffd" and prefixes[1] == "こん\ufffd"
    detokenizer = make(kind, tokenizer, [], True)
    released = ""
    for token_id, prefix in zip(ids, prefixes, strict=True):
        released += detokenizer.decode_next(token_id)
        assert released == prefix.rstrip("\ufffd")
    assert released + detokenizer.flush() == "こんにちは世界。"
