"""One sample (one engine-core child request) on its way to a ``CompletionOutput``.

Follows vLLM's choices where the brief left room:

- ``token_ids`` holds every sampled id, including the EOS / stop token id that ended the
  sample; after a stop string, ids that followed the token completing it are dropped.
- A sample the engine core finished with "stop" (EOS or a stop token id) does not
  detokenize that last token unless ``include_stop_str_in_output``.
- Stop strings are only searched once more than ``min_tokens`` tokens exist; text of the
  first ``min_tokens`` tokens cannot end a match.
- Streamed text (DELTA and CUMULATIVE) withholds the longest suffix that could still
  grow into a stop string (unless the stop string is to be included anyway); finished
  outputs carry all text.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.engine.logprobs_processor import LogprobsProcessor
from pagedlm.engine.stop_strings import StopMatch, find_stop_string, stop_string_holdback
from pagedlm.outputs import CompletionOutput
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


class UpdateResult(NamedTuple):
    changed: bool
    """New tokens were kept or the completion finished: it has something to report."""
    stopped_by_string: bool
    """A stop string finished it while the engine core still runs it (abort it there)."""


_CHANGED = UpdateResult(True, False)
_UNCHANGED = UpdateResult(False, False)


class CompletionState:
    """Token ids, text and logprobs of one sample, plus what was already streamed.

    Invariants: ``text`` is the detokenized ``token_ids`` (cut at a stop string);
    ``_sent_tokens <= len(token_ids)`` and ``_sent_text <= len(text)`` count what DELTA
    outputs already carried.
    """

    def __init__(
        self,
        index: int,
        request_id: str,
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        logprobs: LogprobsProcessor,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.detokenizer = detokenizer
        self.logprobs = logprobs
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens

        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self._sent_tokens = 0
        self._sent_text = 0
        self._ids_only = detokenizer is None and not (
            logprobs.wants_logprobs or logprobs.wants_prompt_logprobs
        )
        """No text and no logprobs to keep: an update only appends ids (the common case
        of offline benchmarks and ``skip_tokenizer_init``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> UpdateResult:
        """Fold one step's engine-core output into this completion."""
        if self._ids_only:
            if output.num_cached_tokens > self.num_cached_tokens:
                self.num_cached_tokens = output.num_cached_tokens
            self.token_ids += output.new_token_ids
            if output.finish_reason is not None:
                self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
                return _CHANGED
            return _CHANGED if output.new_token_ids else _UNCHANGED
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.logprobs.add_prompt_rows(output.new_prompt_logprobs)
        new_token_ids = output.new_token_ids
        # The token that made the engine core stop (EOS / stop id) keeps its id, not its text.
        skip_last_text = (
            output.finish_reason == "stop" and bool(new_token_ids) and not self.include_stop_str
        )
        match: StopMatch | None = None
        num_kept = 0
        for position, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            num_kept += 1
            if self.detokenizer is None or (skip_last_text and position == len(new_token_ids) - 1):
                continue
            match = self._append_text(self.detokenizer.decode_next(token_id))
            if match is not None:
                break
        self.logprobs.add_sample_rows(output.new_logprobs, num_kept, self.request_id)
        if match is None and output.finished and self.detokenizer is not None:
            match = self._append_text(self.detokenizer.flush())
        if match is not None:
            self.finish_reason, self.stop_reason = "stop", match.stop_string
        elif output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        stopped_by_string = match is not None and not output.finished
        return UpdateResult(num_kept > 0 or self.finished, stopped_by_string)

    def _append_text(self, new_text: str) -> StopMatch | None:
        if not new_text:
            return None
        search_from = len(self.text)
        self.text += new_text
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = find_stop_string(self.text, self.stop, search_from, self.include_stop_str)
        if match is not None:
            self.text = self.text[: match.truncate_to]
        return match

    def _releasable_text_length(self) -> int:
        if self.finished or not self.stop or self.include_stop_str:
            return len(self.text)
        return len(self.text) - stop_string_holdback(self.text, self.stop)

    def make_output(self, kind: RequestOutputKind) -> CompletionOutput:
        """This completion as the user sees it now.

        DELTA returns only what is new since the previous DELTA call (and advances that
        mark); CUMULATIVE and FINAL_ONLY return everything, as fresh lists.
        """
        text_end = max(self._releasable_text_length(), self._sent_text)
        sample_logprobs = self.logprobs.logprobs
        if kind is RequestOutputKind.DELTA:
            text = self.text[self._sent_text : text_end]
            token_ids = self.token_ids[self._sent_tokens :]
            if sample_logprobs is not None:
                sample_logprobs = sample_logprobs[self._sent_tokens :]
            self._sent_text = text_end
            self._sent_tokens = len(self.token_ids)
        else:
            text = self.text[:text_end]
            token_ids = list(self.token_ids)
            if sample_logprobs is not None:
                sample_logprobs = list(sample_logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=sample_logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
        )
