"""get_tokenizer: GGUF-embedded vocabularies (built fast, checked against ground truth and
transformers), Hugging Face directories, and the errors for everything else."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_gguf import finish

from pagedlm.tokenizer import get_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024 there were 365 days; in 1999, 12 months had 31 or 30 days.",
    "Tokenizers split text into pieces: words, sub-words and bytes!",
    "Ünïcödé tëxt, 中文字符 and emoji 🦙 should round-trip.",
    "def add(a, b):\n    return a + b  # spaces   and\ttabs",
] * 20

SAMPLES = [
    "The fox jumps over 12345 dogs.",
    "  leading spaces\n\nand newlines\t",
    "<|im_start|>user\nHi there<|im_end|>",
    "a <think> marker",
    "中文 🦙 ünïcödé",
    "",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_byte_level_bpe(split_digits: bool):
    """A small byte-level BPE trained on CORPUS: the ground truth the GGUF vocabulary encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens(["<think>"])
    return tokenizer


def write_tokenizer_gguf(path, truth, pre: str, add_bos: bool) -> str:
    """A llama GGUF carrying ``truth``'s vocabulary the way convert_hf_to_gguf writes it."""
    import gguf

    vocab = truth.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(truth.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 4 if t == "<think>" else 1 for t in tokens]

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8),
                       ("attention.head_count", 2), ("context_length", 64)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    finish(writer)
    return str(path)


@pytest.mark.parametrize(("pre", "split_digits"), [("gpt-2", False), ("smollm", True)])
def test_gguf_vocabulary_matches_ground_truth(tmp_path, pre, split_digits):
    truth = train_byte_level_bpe(split_digits)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", truth, pre, add_bos=False)
    tokenizer = get_tokenizer(path)
    assert len(tokenizer) == truth.get_vocab_size(with_added_tokens=True)
    for text in SAMPLES:
        expected = truth.encode(text).ids
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.decode(expected) == text
    assert tokenizer.convert_tokens_to_ids("<think>") == truth.token_to_id("<think>")
    assert (
        tokenizer.decode(tokenizer.encode(SAMPLES[2]), skip_special_tokens=True) == "user\nHi there"
    )


def test_pre_tokenizer_tag_decides_digit_splitting(tmp_path):
    # Trained without digit splitting, the vocabulary has multi-digit merges ("2024")...
    truth = train_byte_level_bpe(split_digits=False)
    text = "in 2024 and 365"

    def digits_per_piece(pre: str) -> list[int]:
        tokenizer = get_tokenizer(write_tokenizer_gguf(tmp_path / f"{pre}.gguf", truth, pre, False))
        return [sum(ch.isdigit() for ch in piece) for piece in tokenizer.tokenize(text)]

    assert max(digits_per_piece("gpt-2")) > 1
    # ...which llama.cpp's "smollm" (StarCoder) pre-tokenizer never uses: one digit per piece.
    assert max(digits_per_piece("smollm")) == 1


def test_gguf_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    truth = train_byte_level_bpe(split_digits=False)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", truth, "gpt-2", add_bos=True)
    ours = get_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    bos = truth.token_to_id("<|im_start|>")
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == bos and ids[1:] == truth.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert ours.special_tokens_map == theirs.special_tokens_map
    messages = [{"role": "user", "content": "Hi"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_sentencepiece_vocabulary_goes_through_transformers(tmp_path):
    import gguf
    from transformers import AutoTokenizer

    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁c"]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0, *(-float(i) for i in range(len(tokens) - 3))])
    writer.add_token_types([2, 3, 3, *[1] * (len(tokens) - 3)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    finish(writer)
    ours = get_tokenizer(str(tmp_path / "spm.gguf"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.encode("ab c abc") == theirs.encode("ab c abc")
    assert ours.encode("ab c")[0] == 1  # sentencepiece vocabularies add BOS


def test_directory_tokenizer(tmp_path, llama_gguf_factory):
    from transformers import PreTrainedTokenizerFast

    truth = train_byte_level_bpe(split_digits=False)
    PreTrainedTokenizerFast(tokenizer_object=truth, eos_token="<|im_end|>").save_pretrained(
        tmp_path
    )
    assert get_tokenizer(str(tmp_path)).encode(SAMPLES[0]) == truth.encode(SAMPLES[0]).ids
    # A GGUF model with a tokenizer directory: the directory wins.
    gguf_path, _, _ = llama_gguf_factory("F32")
    from_dir = get_tokenizer(str(gguf_path), str(tmp_path))
    assert from_dir.encode(SAMPLES[0]) == truth.encode(SAMPLES[0]).ids


def test_errors_say_what_to_pass(tmp_path, llama_gguf_factory):
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a directory"):
        get_tokenizer("no-such-model-anywhere")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        get_tokenizer(str(tmp_path))  # an empty directory
    gguf_path, _, _ = llama_gguf_factory("F32")  # weights only, no vocabulary
    with pytest.raises(ValueError, match=r"no embedded vocabulary.*tokenizer="):
        get_tokenizer(str(gguf_path))


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_path):
    """(ours, transformers') tokenizers of the SmolLM2 GGUF; transformers' takes ~5-10 s."""
    import os

    from transformers import AutoTokenizer

    directory, name = os.path.split(smollm2_path)
    return get_tokenizer(smollm2_path), AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    question = "What is the capital of France?"
    assert ours.encode(question) == theirs.encode(question) == [1780, 314, 260, 3575, 282, 4649, 47]
    for text in [*SAMPLES, *CORPUS[:5], "<repo_name>x<file_sep>y", "x=123; y = 4.56"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_smollm2_chat_template_is_chatml(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    messages = [{"role": "user", "content": question} for question in ["Hi!"]]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi!<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
