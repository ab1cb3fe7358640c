"""A GGUF file's byte-level BPE vocabulary as a tokenizer, built without ``transformers``.

llama.cpp's byte-level BPE (the GPT-2 split regex, optionally after splitting every digit,
then the merges) is expressible with the ``tokenizers`` library alone. ``GGUFTokenizer``
wraps that ``tokenizers.Tokenizer`` in the part of transformers' tokenizer interface that
pagedlm uses (encode/decode, special tokens, vocabulary, chat template), with the same
results as ``PreTrainedTokenizerFast`` around the same backend (``as_transformers``;
``tests/loader/test_tokenizer.py``). Serving a GGUF model therefore never imports
transformers, whose import alone takes seconds (2.5 s on a 2-core machine).

Invariant: every method answers from ``backend_tokenizer`` and the special tokens given at
construction; nothing is cached that could disagree with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# llama.cpp token types (gguf.TokenType) that must be matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is the GPT-2 split regex, optionally
# preceded by splitting every digit on its own (\p{N}); both are expressible with `tokenizers`.
GPT2_SPLIT = frozenset({"gpt-2", "mpt", "olmo", "jais"})
DIGITS_THEN_GPT2_SPLIT = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"}
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
"""transformers' order of the special tokens in ``special_tokens_map``."""


def is_byte_level_bpe(metadata: dict[str, Any]) -> bool:
    """Whether the GGUF metadata describe a vocabulary ``byte_level_bpe_tokenizer`` builds."""
    return metadata.get("tokenizer.ggml.model") == "gpt2" and (
        metadata.get("tokenizer.ggml.pre") in GPT2_SPLIT | DIGITS_THEN_GPT2_SPLIT
    )


class GGUFTokenizer:
    """Encode, decode and render chats with a ``tokenizers.Tokenizer``, answering like
    transformers' fast tokenizer with ``clean_up_tokenization_spaces=False``."""

    truncation_side = "right"
    """transformers' attribute: where ``truncation`` cuts (the engine sets it)."""

    is_fast = True
    padding_side = "right"

    def __init__(
        self,
        backend: Any,
        special_tokens: dict[str, str | None],
        chat_template: str | None,
        name_or_path: str = "",
    ) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self._special = {name: special_tokens.get(name) for name in _SPECIAL_NAMES}

    # ---- special tokens -----------------------------------------------------------------

    bos_token = property(lambda self: self._special["bos_token"])
    eos_token = property(lambda self: self._special["eos_token"])
    unk_token = property(lambda self: self._special["unk_token"])
    pad_token = property(lambda self: self._special["pad_token"])
    bos_token_id = property(lambda self: self._id_of(self.bos_token))
    eos_token_id = property(lambda self: self._id_of(self.eos_token))
    unk_token_id = property(lambda self: self._id_of(self.unk_token))
    pad_token_id = property(lambda self: self._id_of(self.pad_token))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: token for name, token in self._special.items() if token is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(token) for token in self.all_special_tokens]

    # ---- vocabulary ---------------------------------------------------------------------

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            token_id = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(token_id) for token_id in ids]

    # ---- text <-> ids -------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """One text's ``tokenizers.Encoding``. Through ``encode_batch``, which lets other
        Python threads run while it works (``encode`` holds the interpreter throughout:
        a 1 MB prompt encoded on the server's tokenizer thread stalled its event loop for
        seconds), and which transformers' fast tokenizers use for one text too."""
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._encode(text, add_special_tokens).tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, add_special_tokens).ids

    def __call__(
        self,
        text: str,
        add_special_tokens: bool = True,
        truncation: bool | str = False,
        max_length: int | None = None,
    ) -> dict[str, list[int]]:
        """``{"input_ids": ...}`` of one text (transformers' ``BatchEncoding`` keys);
        ``truncation`` cuts the text's tokens on ``truncation_side`` to ``max_length`` with
        the special tokens, which stay, as transformers does."""
        backend = self.backend_tokenizer
        encoding = self._encode(text, add_special_tokens=False)
        if truncation not in (False, "do_not_truncate") and max_length is not None:
            specials = backend.post_processor.num_special_tokens_to_add(False)
            encoding.truncate(
                max(max_length - specials * add_special_tokens, 0),
                direction=self.truncation_side,
            )
        if add_special_tokens:
            encoding = backend.post_process(encoding)
        ids = encoding.ids
        return _Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces=True is not supported for BPE.")
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return self.backend_tokenizer.decode_batch(
            [list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens
        )

    # ---- chats --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template`` for one or a batch of conversations:
        text (``tokenize=False``), ids (``return_dict=False``) or ``{"input_ids": ...}``.
        The template's own special tokens are in its text: ids are encoded without
        adding more."""
        from pagedlm.chat_templates import render_chat_template

        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                "This tokenizer has no chat template; pass chat_template=<a Jinja template>."
            )
        batched = bool(conversation) and isinstance(conversation[0], list | tuple)
        conversations = conversation if batched else [conversation]
        texts = [
            render_chat_template(
                template,
                chat,
                special_tokens=self.special_tokens_map,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
            for chat in conversations
        ]
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        if not return_dict:
            return ids if batched else ids[0]
        return _Encoding(input_ids=ids if batched else ids[0])


class _Encoding(dict):
    """A dict whose keys are also attributes (``encoding.input_ids``), as transformers'."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def byte_level_bpe_tokenizer(metadata: dict[str, Any], name_or_path: str = "") -> GGUFTokenizer:
    """Byte-level BPE as llama.cpp runs it, from the metadata ``is_byte_level_bpe`` accepts."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

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
    if metadata["tokenizer.ggml.pre"] in DIGITS_THEN_GPT2_SPLIT:
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
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    return GGUFTokenizer(
        backend,
        {name: special(key) for name, key in names.items()},
        metadata.get("tokenizer.chat_template"),
        name_or_path,
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
