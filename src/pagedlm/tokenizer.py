"""Load a model's tokenizer: from a Hugging Face directory, or from the vocabulary in a GGUF file.

A GGUF carries no ``tokenizer.json``; it stores the vocabulary, merges, token types, special
token ids and chat template as metadata (llama.cpp key names). transformers can rebuild a
tokenizer from that (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), but it first parses
the whole header with ``gguf.GGUFReader`` (several seconds for a 49k vocabulary). For byte-level
BPE vocabularies, the kind SmolLM2, GPT-2 and StarCoder use, we build the same tokenizer directly
from our fast header reader with the ``tokenizers`` library (``gguf_tokenizer.GGUFTokenizer``:
transformers is not even imported); any other kind goes through transformers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pagedlm.gguf_tokenizer import GGUFTokenizer, byte_level_bpe_tokenizer, is_byte_level_bpe
from pagedlm.model_executor.loader.gguf_reader import read_gguf_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagedlm.config import ModelConfig


TOKENIZER_MODES = ("auto", "hf", "slow")
"""vLLM's ``tokenizer_mode`` values pagedlm takes: "auto" and "hf" (transformers' fast
tokenizer where the checkpoint has one), "slow" (its Python tokenizer)."""
_REFUSED_MODES = {
    "mistral": "it needs mistral_common's tokenizer, which pagedlm does not use",
    "custom": "pagedlm registers no custom tokenizers",
    "deepseek_v32": "pagedlm has no DeepSeek-V3.2 tokenizer",
}


def check_tokenizer_mode(mode: str) -> str:
    if mode in _REFUSED_MODES:
        raise ValueError(
            f"tokenizer_mode={mode!r} is not supported ({_REFUSED_MODES[mode]}); use 'auto' "
            "(the checkpoint's tokenizer.json)."
        )
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode={mode!r} is unknown; use one of {list(TOKENIZER_MODES)}.")
    return mode


def get_tokenizer(
    model: str,
    tokenizer: str | None = None,
    *,
    trust_remote_code: bool = False,
    mode: str = "auto",
) -> PreTrainedTokenizerBase | GGUFTokenizer:
    """The tokenizer for ``model``, or from ``tokenizer`` when given.

    A ``.gguf`` path yields the tokenizer and chat template embedded in the file (a
    ``GGUFTokenizer`` for byte-level BPE vocabularies); a directory goes through
    ``AutoTokenizer`` (local files only: nothing is downloaded), its Python tokenizer with
    ``mode="slow"``. Nothing is cached between calls.
    """
    check_tokenizer_mode(mode)
    source = os.fspath(tokenizer if tokenizer is not None else model)
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise ValueError(f"GGUF file {source} does not exist; check the path.")
        if mode == "slow":
            raise ValueError(
                f"tokenizer_mode='slow' needs a Hugging Face tokenizer, but {source} carries "
                "its vocabulary itself; use 'auto', or pass tokenizer=<a directory>."
            )
        return _gguf_tokenizer(source)
    if os.path.isdir(source):
        return _directory_tokenizer(source, trust_remote_code, use_fast=mode != "slow")
    raise ValueError(
        f"Cannot load a tokenizer from {source!r}: it is neither a .gguf file nor a directory. "
        "Pass tokenizer=<a Hugging Face directory with tokenizer.json> or a .gguf file."
    )


def _directory_tokenizer(
    path: str, trust_remote_code: bool, use_fast: bool = True
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True, use_fast=use_fast
        )
    except Exception as error:
        raise ValueError(
            f"Cannot load a tokenizer from {path}: {error}. The directory needs tokenizer.json "
            "(or tokenizer.model) and tokenizer_config.json; pass tokenizer=<another directory> "
            "if the tokenizer lives elsewhere."
        ) from error


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase | GGUFTokenizer:
    metadata = read_gguf_header(path).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(
            f"{path} has no embedded vocabulary (tokenizer.ggml.tokens); pass "
            "tokenizer=<a Hugging Face directory with the model's tokenizer.json>."
        )
    if is_byte_level_bpe(metadata):
        return byte_level_bpe_tokenizer(metadata, path)
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


def as_transformers(tokenizer: Any) -> PreTrainedTokenizerBase:
    """``tokenizer`` as a transformers tokenizer, for libraries that take nothing else
    (xgrammar): a ``GGUFTokenizer`` becomes a ``PreTrainedTokenizerFast`` around the same
    backend and special tokens; anything else is returned as it is."""
    if not isinstance(tokenizer, GGUFTokenizer):
        return tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    ids = tokenizer.encode("", add_special_tokens=True)
    add_bos = bool(ids) and ids[0] == tokenizer.bos_token_id
    add_eos = bool(ids) and ids[-1] == tokenizer.eos_token_id and (len(ids) > 1 or not add_bos)
    return PreTrainedTokenizerFast(
        # A copy: transformers may reconfigure the backend it is given.
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
        **tokenizer.special_tokens_map,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=tokenizer.chat_template,
        clean_up_tokenization_spaces=False,
    )


def model_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase | GGUFTokenizer:
    """The tokenizer an engine's ``ModelConfig`` names (its source and mode)."""
    return get_tokenizer(model.model, model.tokenizer, mode=model.tokenizer_mode)
