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
    for text in SAMPLES:  # tokenization_kwargs go to __call__, as transformers takes them
        for kwargs in ({"add_special_tokens": False}, {"truncation": True, "max_length": 3}):
            for side in ("right", "left"):
                ours.truncation_side = theirs.truncation_side = side
                assert ours(text, **kwargs)["input_ids"] == theirs(text, **kwargs)["input_ids"]
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


VARIED = [
    *SAMPLES,
    "Tabs\tand  double  spaces,\r\nCRLF lines\n\n\n and trailing space ",
    "Numbers: 3.14159, -42, 1e-9, 0x1F, 2024-12-02T07:31:48Z",
    "Emoji sequences 👩‍👩‍👧‍👦 🇫🇷 and combining marks: e\u0301 n\u0303",
    "Arabic مرحبا, Hindi नमस्ते, Korean 안녕하세요, Cyrillic привет",
    "<|im_start|><|im_end|><|endoftext|> glued<|im_end|>text<think>x</think>",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
    "```python\nprint('hi')\n```",
    " ",
    "\n",
]
CHAT_TEMPLATES = {
    "chatml": CHATML,
    "system_default_and_tojson": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}"
        "{% endif %}{% set ns = namespace(count=0) %}{% for message in messages %}"
        "{% set ns.count = ns.count + 1 %}<|im_start|>{{ message.role }}\n"
        "{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}"
        "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if tools %}Tools: {{ tools | tojson(indent=2) }}\n{% endif %}"
        "{{ ns.count }} messages, bos={{ bos_token }}, eos={{ eos_token }}\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "trimmed_blocks": (
        "{% for message in messages %}\n    {% if message['role'] == 'user' %}\n"
        "User: {{ message['content'] | trim }}\n    {% elif message['role'] == 'assistant' %}\n"
        "Assistant: {{ message['content'] }}{% if not loop.last %}\n\n{% endif %}\n"
        "    {% elif message['role'] == 'system' %}{{ message['content'] ~ '\n' }}"
        "    {% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
        "{% endfor %}"
    ),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Où est le café? 中文 🦙"},
        {"role": "assistant", "content": "Arr, <think>there</think>", "tool_calls": None},
        {"role": "user", "content": "  and now?  "},
    ],
    [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
    ],
]
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def byte_level_tokenizers(tmp_path_factory):
    """(ours, transformers' PreTrainedTokenizerFast around the same vocabulary, transformers'
    own GGUF tokenizer) for a trained byte-level BPE with digit splitting and BOS."""
    from transformers import AutoTokenizer

    from pagedlm.tokenizer import as_transformers

    directory = tmp_path_factory.mktemp("tok")
    truth = train_byte_level_bpe(split_digits=True)
    path = write_tokenizer_gguf(directory / "tok.gguf", truth, "smollm", add_bos=True)
    ours = get_tokenizer(path)
    return (
        ours,
        as_transformers(ours),
        AutoTokenizer.from_pretrained(directory, gguf_file="tok.gguf"),
    )


def test_gguf_tokenizer_is_built_without_transformers(byte_level_tokenizers):
    from transformers import PreTrainedTokenizerFast

    from pagedlm.gguf_tokenizer import GGUFTokenizer

    ours, fast, _ = byte_level_tokenizers
    assert isinstance(ours, GGUFTokenizer) and not isinstance(ours, PreTrainedTokenizerFast)
    assert isinstance(fast, PreTrainedTokenizerFast)


def test_gguf_tokenizer_encodes_and_decodes_like_transformers(byte_level_tokenizers):
    ours, fast, from_gguf = byte_level_tokenizers
    for text in VARIED:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == fast.encode(text, add_special_tokens=special), (text, special)
            assert ids == from_gguf.encode(text, add_special_tokens=special), (text, special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == fast.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text  # round trip
        assert ours.tokenize(text) == fast.tokenize(text)
        assert ours.convert_ids_to_tokens(ids) == fast.convert_ids_to_tokens(ids)
        assert ours(text).input_ids == fast(text).input_ids
    batch = [ours.encode(text) for text in VARIED]
    assert ours.batch_decode(batch) == fast.batch_decode(batch)
    assert ours.decode(5) == fast.decode(5)
    assert (len(ours), ours.vocab_size) == (len(fast), fast.vocab_size)
    assert ours.get_vocab() == fast.get_vocab()
    assert ours.special_tokens_map == fast.special_tokens_map
    assert sorted(ours.all_special_ids) == sorted(fast.all_special_ids)
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token_id") == getattr(fast, f"{name}_token_id"), name
    assert ours.convert_tokens_to_ids(["<think>", "never-a-token"]) == fast.convert_tokens_to_ids(
        ["<think>", "never-a-token"]
    )


def test_encoding_a_long_text_lets_other_threads_run(byte_level_tokenizers):
    """The server tokenizes on a worker thread; ``tokenizers``' ``encode`` held the
    interpreter for the whole text, so the event loop stood still (~1 s here)."""
    import threading
    import time

    ours = byte_level_tokenizers[0]
    text = "ab 12 cd " * 60_000
    worst, done = 0.0, threading.Event()

    def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    try:
        for encode in (ours.encode, lambda t: ours(t).input_ids):
            assert len(encode(text)) > 100_000
    finally:
        done.set()
        ticker.join()
    took = time.perf_counter() - start
    assert worst < max(0.25, took / 6), (worst, took)


@pytest.mark.parametrize("template", sorted(CHAT_TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_templates_render_like_transformers(byte_level_tokenizers, template, conversation):
    ours, fast, _ = byte_level_tokenizers
    messages = CONVERSATIONS[conversation]
    for generation_prompt in (False, True):
        kwargs = {
            "chat_template": CHAT_TEMPLATES[template],
            "add_generation_prompt": generation_prompt,
            "tools": TOOLS,
        }
        expected = fast.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == expected
        ids = ours.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert ids == fast.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs)["input_ids"] == ids


def test_continue_final_message_and_template_errors_like_transformers(byte_level_tokenizers):
    import jinja2

    ours, fast, _ = byte_level_tokenizers
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I "}]
    for template in (CHATML, CHAT_TEMPLATES["trimmed_blocks"]):
        kwargs = {"chat_template": template, "continue_final_message": True, "tokenize": False}
        assert ours.apply_chat_template(prefill, **kwargs) == fast.apply_chat_template(
            prefill, **kwargs
        )
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template(
            [{"role": "tool", "content": "x"}],
            chat_template=CHAT_TEMPLATES["trimmed_blocks"],
            tokenize=False,
        )
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(prefill, continue_final_message=True, add_generation_prompt=True)


def test_serving_a_gguf_tokenizer_imports_no_transformers(tmp_path):
    import subprocess
    import sys

    truth = train_byte_level_bpe(split_digits=False)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", truth, "gpt-2", add_bos=False)
    script = (
        "import sys\n"
        "from pagedlm.tokenizer import get_tokenizer\n"
        f"tok = get_tokenizer({path!r})\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}],"
        " add_generation_prompt=True, return_dict=False)\n"
        "print(tok.decode(ids + tok.encode(' there')))\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n there\n"


def test_tokenizer_mode_takes_vllms_names(tmp_path, monkeypatch, chat_checkpoint, smollm2_path):
    import transformers

    from pagedlm.engine.arg_utils import EngineArgs

    asked = []
    load = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        asked.append(kwargs.get("use_fast"))
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    for mode, use_fast in (("auto", True), ("hf", True), ("slow", False)):
        config, _ = EngineArgs(str(chat_checkpoint), tokenizer_mode=mode).create_engine_config()
        assert config.model.tokenizer_mode == mode
        from pagedlm.tokenizer import model_tokenizer

        asked.clear()
        assert model_tokenizer(config.model).encode("hi")
        assert asked == [use_fast]
    for mode, message in (("mistral", "mistral_common"), ("fast", "unknown")):
        with pytest.raises(ValueError, match=message):
            EngineArgs("/nonexistent", tokenizer_mode=mode).create_engine_config()
    with pytest.raises(ValueError, match="carries its vocabulary itself"):
        get_tokenizer(smollm2_path, mode="slow")
    with pytest.raises(ValueError, match="tokenizer_revision applies to a hub id"):
        EngineArgs(str(chat_checkpoint), tokenizer_revision="main").resolve_tokenizer()


def test_tokenizer_revision_picks_the_tokenizers_snapshot(monkeypatch):
    from pagedlm.engine import arg_utils

    calls = []
    monkeypatch.setattr(
        arg_utils, "resolve_model_path", lambda *args, **kwargs: calls.append(args) or "/snap"
    )
    EngineArgs = arg_utils.EngineArgs
    assert EngineArgs("org/model", tokenizer_revision="v2").resolve_tokenizer() == "/snap"
    assert EngineArgs("org/model", tokenizer="org/tok", revision="r1").resolve_tokenizer()
    assert EngineArgs("org/model", tokenizer="org/tok", revision="r1",
                      tokenizer_revision="t1").resolve_tokenizer()  # fmt: skip
    assert EngineArgs("org/model", revision="r1").resolve_tokenizer() is None  # the model's own
    assert calls == [
        ("Tokenizer", "org/model", "v2"), ("Tokenizer", "org/tok", "r1"),
        ("Tokenizer", "org/tok", "t1"),
    ]  # fmt: skip
