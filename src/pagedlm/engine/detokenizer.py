"""Incremental detokenization: output token ids -> text, one token at a time.

Decoding a growing id list from scratch each step is quadratic, and decoding each token
alone is wrong (byte-level BPE splits multi-byte UTF-8 characters such as "é", "日" or
emoji across tokens, and some decoders strip or add spaces depending on the neighbours).
Both detokenizers here decode a short *window* of recent ids and release only the text
that the newest token added. While the window's text ends in an incomplete character
("\\ufffd") only that character is held back: the whole characters before it are released
at once, since a byte-level token often ends a character and begins the next (CJK text),
and holding the whole token would stall streaming and let a stop string that the token
completes go unseen until some later token ends on a character boundary. Invariant: for a
context-free decoder (byte-level BPE) the concatenation of everything ``decode_next`` and
``flush`` return equals ``decode(output_ids)`` with the same ``skip_special_tokens``, and
after each token it is the longest prefix of that decode ending on a whole character.

- ``FastIncrementalDetokenizer`` drives the ``tokenizers`` library's ``DecodeStream`` (the
  window logic runs in Rust) for tokenizers backed by ``tokenizers.Tokenizer``.
- ``OffsetIncrementalDetokenizer`` runs the same prefix/read-offset algorithm in Python on
  any ``decode(ids) -> str``, for every other tokenizer.

Both are primed with a short clean suffix of the prompt so that context-dependent decoders
(e.g. SentencePiece's leading "▁") render the first output token as it reads after the
prompt. ``clean_up_tokenization_spaces`` is never applied: it rewrites text already
released (" ." -> "."), so it cannot be streamed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from pagedlm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder emits for bytes that are not (yet) a complete UTF-8 character."""

_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24
_CONTEXT_TOKENS = 4
"""Released ids kept as left context for a decode stream restart or a final flush."""
_MAX_TOKEN_ID = 2**32 - 1


class IncrementalDetokenizer(ABC):
    """Text of one completion, released token by token.

    Call ``decode_next`` once per output token id in order, then ``flush`` once when the
    completion finishes.
    """

    @abstractmethod
    def decode_next(self, token_id: int) -> str:
        """The text that became final with ``token_id`` ("" while a character is incomplete)."""

    @abstractmethod
    def flush(self) -> str:
        """The text still held back at the end (an incomplete character decodes as "\\ufffd")."""


class OffsetIncrementalDetokenizer(IncrementalDetokenizer):
    """The prefix/read-offset algorithm over any ``decode(ids) -> str``.

    ``ids[prefix_offset:read_offset]`` is the window whose text was already released
    (``prefix_text``); ``ids[read_offset:]`` are ids whose text is only partly released
    (``_early_text``: the whole characters before an incomplete one). Each step decodes
    ``ids[prefix_offset:]`` and releases what it adds beyond both.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._early_text = ""

    def decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text):
            return ""
        if text.endswith(REPLACEMENT_CHAR):
            whole = _whole_characters(text, self._prefix_text, self._early_text)
            new_text = whole[len(self._early_text) :]
            self._early_text = whole
            return new_text
        return self._release(text)

    def flush(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        return self._release(self._decode(self._ids[self._prefix_offset :]))

    def _release(self, text: str) -> str:
        if text.startswith(self._prefix_text):
            new_text = text[len(self._prefix_text) :]
        else:
            # A decoder that rewrites earlier text cannot be streamed exactly; release the
            # pending ids decoded on their own rather than repeat released text.
            new_text = self._decode(self._ids[self._read_offset :])
        new_text = _after_early_text(new_text, self._early_text)
        self._early_text = ""
        # Slide the window: the ids just released become the next prefix.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """``tokenizers.decoders.DecodeStream`` plus what it lacks: a flush and a recovery.

    ``DecodeStream.step`` returns None while the text ends in an incomplete character and
    never releases those ids on its own, so we track the ids since the last release
    (``_ids[_released:]``) to flush them at the end. It raises "Invalid prefix" when the
    decoder rewrites earlier text (a non-monotonic decoder); then we replay the pending
    ids on a fresh stream instead of failing the request.

    While the stream holds text back, the whole characters before the incomplete one are
    released early (``_early_text``) from our own decode of the pending ids, and cut from
    the front of what the stream releases later.

    With ``skip_special_tokens=False`` and ``spaces_between_special_tokens=False``, an
    added token that directly follows another added token is rendered as its bare
    content, dropping the separator some decoders (WordPiece) put between tokens.
    """

    def __init__(
        self,
        backend: Any,
        context_ids: Sequence[int],
        skip_special_tokens: bool,
        added_token_contents: dict[int, str] | None = None,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._stream_cls = DecodeStream
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._added_token_contents = added_token_contents
        self._previous_was_added = False
        self._ids = list(context_ids)[-_MAX_PRIME_TOKENS:]
        self._released = len(self._ids)
        self._stream = self._new_stream(self._ids)
        self._early_text = ""
        self._released_text: str | None = None
        """``decode(_ids[:_released])``, cached while text is held back."""

    def decode_next(self, token_id: int) -> str:
        if not 0 <= token_id <= _MAX_TOKEN_ID:
            return ""  # cannot come from a real vocabulary; DecodeStream would raise
        self._ids.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as error:
            if not _is_invalid_prefix(error):
                raise
            text = self._restart()
        else:
            if text is not None:
                self._mark_released(len(self._ids))
        if self._added_token_contents is not None:
            content = self._added_token_contents.get(token_id)
            if text is not None and content is not None and self._previous_was_added:
                text = content
            self._previous_was_added = content is not None
        if text is None:
            return self._release_early()
        text = _after_early_text(text, self._early_text)
        self._early_text = ""
        return text

    def flush(self) -> str:
        if self._released == len(self._ids):
            return ""
        text = self._pending_text()
        self._mark_released(len(self._ids))
        text = _after_early_text(text, self._early_text)
        self._early_text = ""
        return text

    def _pending_text(self) -> str:
        """The text the ids not released by the stream add to the released ones."""
        if self._released_text is None:
            self._released_text = self._decode(self._ids[: self._released])
        prefix = self._released_text
        full = self._decode(self._ids)
        return (
            full[len(prefix) :]
            if full.startswith(prefix)
            else self._decode(self._ids[self._released :])
        )

    def _release_early(self) -> str:
        """The whole characters the held-back ids decode to, beyond those released already."""
        if self._released == len(self._ids):
            return ""
        whole = _whole_characters(self._pending_text(), "", self._early_text)
        new_text = whole[len(self._early_text) :]
        self._early_text = whole
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _new_stream(self, context_ids: list[int]) -> Any:
        try:
            return self._stream_cls(
                ids=list(context_ids) or None, skip_special_tokens=self._skip_special_tokens
            )
        except TypeError:
            # tokenizers < 0.22 cannot prefill a stream: step the context through it.
            stream = self._stream_cls(skip_special_tokens=self._skip_special_tokens)
            for token_id in context_ids:
                stream.step(self._backend, token_id)
            return stream

    def _mark_released(self, num_released: int) -> None:
        """``_ids[:num_released]`` have been released; keep a few of them as context."""
        drop = max(num_released - _CONTEXT_TOKENS, 0)
        del self._ids[:drop]
        self._released = num_released - drop
        self._released_text = None

    def _restart(self) -> str | None:
        """Replay the pending ids on a fresh stream: primed with released context first,
        then with none (an empty prefix cannot be contradicted)."""
        pending = self._ids[self._released :]
        for context in (self._ids[: self._released], []):
            stream = self._new_stream(context)
            chunks: list[str] = []
            num_released = self._released
            try:
                for offset, token_id in enumerate(pending, start=self._released + 1):
                    chunk = stream.step(self._backend, token_id)
                    if chunk is not None:
                        chunks.append(chunk)
                        num_released = offset
            except Exception as error:
                if not _is_invalid_prefix(error):
                    raise
                continue
            self._stream = stream
            self._mark_released(num_released)
            return "".join(chunks) if chunks else None
        # Even a fresh stream contradicts itself: give up streaming these ids exactly.
        self._stream = self._new_stream([])
        self._mark_released(len(self._ids))
        return self._decode(pending)


def _whole_characters(text: str, prefix: str, early_text: str) -> str:
    """What ``text`` (which ends in an incomplete character) adds beyond ``prefix`` up to
    that character, if it extends the ``early_text`` already released; else
    ``early_text`` (release nothing more)."""
    if not text.startswith(prefix):
        return early_text
    whole = text[len(prefix) :].rstrip(REPLACEMENT_CHAR)
    return whole if len(whole) > len(early_text) and whole.startswith(early_text) else early_text


def _after_early_text(text: str, early_text: str) -> str:
    """``text`` without the ``early_text`` released ahead of it."""
    return text[len(early_text) :] if text.startswith(early_text) else text


def _is_invalid_prefix(error: Exception) -> bool:
    return "invalid prefix" in str(error).lower()


class DetokenizerFactory:
    """Builds the right detokenizer for each request of one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizers_backend(tokenizer)
        self._added_token_contents: dict[int, str] | None = None

    def create(
        self, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        """A detokenizer primed with the prompt, or None when no text is wanted."""
        if not params.detokenize:
            return None
        skip = params.skip_special_tokens
        context = self._prime_ids(prompt_token_ids, skip)
        if self._backend is None or not _has_decode_stream():
            return OffsetIncrementalDetokenizer(self._slow_decoder(skip), context)
        added = None
        if not skip and not params.spaces_between_special_tokens:
            added = self._added_tokens() or None
        return FastIncrementalDetokenizer(self._backend, context, skip, added)

    def _slow_decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        backend = self._backend
        if backend is not None:
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        tokenizer = self.tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )

        return decode

    def _prime_ids(self, prompt_token_ids: Sequence[int], skip: bool) -> list[int]:
        """The shortest prompt suffix of at least 4 ids that decodes to whole characters.

        A suffix that starts or ends inside a character would leak its bytes into the
        first output token, so if none is clean within 24 ids we do not prime at all.
        """
        num_prompt = len(prompt_token_ids)
        shortest = min(_MIN_PRIME_TOKENS, num_prompt)
        for length in range(max(shortest, 1), min(num_prompt, _MAX_PRIME_TOKENS) + 1):
            suffix = list(prompt_token_ids[-length:])
            if REPLACEMENT_CHAR not in self._decode(suffix, skip):
                return suffix
        return []

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self._slow_decoder(skip)(ids)

    def _added_tokens(self) -> dict[int, str]:
        if self._added_token_contents is None:
            decoder = self._backend.get_added_tokens_decoder()
            self._added_token_contents = {tid: tok.content for tid, tok in decoder.items()}
        return self._added_token_contents


def _has_decode_stream() -> bool:
    """``DecodeStream`` appeared in tokenizers 0.21; older versions use the Python path."""
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return False
    return True


def tokenizers_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer (or a bare one), else None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None
