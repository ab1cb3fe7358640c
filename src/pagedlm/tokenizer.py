"""Load a model's tokenizer: from a Hugging Face directory, or from the vocabulary in a GGUF file.

A GGUF carries no ``tokenizer.json``; it stores the vocabulary, merges, token types, special
token ids and chat template as metadata (llama.cpp key names). transformers can rebuild a
tokenizer from that (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), but it first parses
the whole header with ``gguf.GGUFReader`` (several seconds for a 49k vocabulary). For byte-level
BPE vocabularies, the kind SmolLM2, GPT-2 and StarCoder use, we build the same tokenizer directly
from our fast header reader; any other kind goes through transformers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pagedlm.model_executor.loader.gguf_loader import read_gguf_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# llama.cpp token types (gguf.TokenType) that must be matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is the GPT-2 split regex, optionally
# preceded by splitting every digit on its own (\p{N}); both are expressible with `tokenizers`.
_GPT2_SPLIT = frozenset({"gpt-2", "mpt", "olmo", "jais"})
_DIGITS_THEN_GPT2_SPLIT = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"}
)


def get_tokenizer(
    model: str, tokenizer: str | None = None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer for ``model``, or from ``tokenizer`` when given.

    A ``.gguf`` path yields the tokenizer and chat template embedded in the file; a directory
    goes through ``AutoTokenizer`` (local files only: nothing is downloaded). Nothing is cached
    between calls.
    """
    source = os.fspath(tokenizer if tokenizer is not None else model)
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise ValueError(f"GGUF file {source} does not exist; check the path.")
        return _gguf_tokenizer(source)
    if os.path.isdir(source):
        return _directory_tokenizer(source, trust_remote_code)
    raise ValueError(
        f"Cannot load a tokenizer from {source!r}: it is neither a .gguf file nor a directory. "
        "Pass tokenizer=<a Hugging Face directory with tokenizer.json> or a .gguf file."
    )


def _directory_tokenizer(path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as error:
        raise ValueError(
            f"Cannot load a tokenizer from {path}: {error}. The directory needs tokenizer.json "
            "(or tokenizer.model) and tokenizer_config.json; pass tokenizer=<another directory> "
            "if the tokenizer lives elsewhere."
        ) from error


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    metadata = read_gguf_header(path).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(
            f"{path} has no embedded vocabulary (tokenizer.ggml.tokens); pass "
            "tokenizer=<a Hugging Face directory with the model's tokenizer.json>."
        )
    if (
        metadata.get("tokenizer.ggml.model") == "gpt2"
        and metadata.get("tokenizer.ggml.pre") in _GPT2_SPLIT | _DIGITS_THEN_GPT2_SPLIT
    ):
        return _byte_level_bpe_tokenizer(metadata)
    return _transformers_gguf_tokenizer(path)


def _transformers_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"Cannot build a tokenizer from the vocabulary in {path}: {error}. Pass "
            "tokenizer=<a Hugging Face directory with the model's tokenizer.json>."
        ) from error


def _byte_level_bpe_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerBase:
    """Byte-level BPE as llama.cpp runs it: GPT-2 split regex (plus per-digit split), merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata["tokenizer.ggml.pre"] in _DIGITS_THEN_GPT2_SPLIT:
        byte_level = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()

    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"The GGUF vocabulary has {len(tokens)} tokens but {len(token_types)} token types; "
            "the file is damaged. Pass tokenizer=<a Hugging Face tokenizer directory>."
        )

    def marked(kind: int, special: bool) -> list[Any]:
        return [
            AddedToken(token, special=special, normalized=False)
            for token, token_kind in zip(tokens, token_types, strict=True)
            if token_kind == kind
        ]

    # The tokens already sit in the vocabulary; registering them only makes them match whole.
    backend.add_special_tokens(marked(_CONTROL, special=True))
    backend.add_tokens(marked(_USER_DEFINED, special=False))

    def special(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _template_post_processor(
        (special("bos"), metadata.get("tokenizer.ggml.bos_token_id")) if add_bos else None,
        (special("eos"), metadata.get("tokenizer.ggml.eos_token_id")) if add_eos else None,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _template_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
    """Adds BOS before / EOS after each sequence when the file asks for it (llama.cpp does too).

    ``bos`` / ``eos``: ``(token, id)`` or None for "do not add".
    """
    from tokenizers import processors

    prefix = [bos[0]] if bos else []
    suffix = [eos[0]] if eos else []
    single = [*prefix, "$A", *suffix]
    return processors.TemplateProcessing(
        single=single,
        pair=[*single, *prefix, "$B:1", *suffix],
        special_tokens=[pair for pair in (bos, eos) if pair is not None],
    )
