"""Engine-core outputs (token ids) -> ``RequestOutput`` (text, logprobs, finish reasons).

One user request with ``n`` samples is ``n`` engine-core child requests; the output
processor is where they meet again. Each step it folds every child's new tokens into its
``CompletionState`` (detokenize, stop strings, logprobs) and then emits at most one
``RequestOutput`` per parent request:

- DELTA: the children that changed this step, each with only its new text / tokens.
- CUMULATIVE: all children, each with everything so far.
- FINAL_ONLY: all children, once, when the last one finishes.

With ``stream_interval`` N > 1 (vLLM's ``--stream-interval``) an unfinished parent speaks
only on its first tokens and then once N more have come (DELTA outputs then carry those
N tokens at once): fewer, larger outputs for a front end serving many streams.

A parent is finished when all its children are. ``prompt_logprobs`` (``[None]`` plus
one dict per later prompt position, gathered across prefill chunks) ride on the first
output in DELTA mode and on every output otherwise. A pooling request's one output is a
``PoolingRequestOutput`` holding the raw vector its finishing step carried. Metrics use
``time.monotonic()``, the clock ``arrival_time`` comes from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.completion_state import CompletionState
from pagedlm.engine.detokenizer import DetokenizerFactory
from pagedlm.engine.logprobs_processor import LogprobsProcessor, TokenTextCache, row_token_ids
from pagedlm.outputs import PromptLogprobs, RequestOutput
from pagedlm.pooling.outputs import PoolingOutput, PoolingRequestOutput, pooled_tensor
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.step import TensorData

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagedlm.lora.request import LoRARequest


class ProcessedOutputs(NamedTuple):
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    """Outputs to hand to the user this step, one per parent request at most."""
    reqs_to_abort: list[str]
    """Child request ids a stop string finished: the engine core must abort them."""


class _ParentRequest:
    """A user request and its ``n`` children."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        children: list[CompletionState],
        arrival_time: float,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = params.output_kind
        self.children = children
        self.num_unfinished = len(children)
        self.prompt_logprobs_sent = False
        self.metrics: dict[str, float] = {"arrival_time": arrival_time}
        self.scheduled = False
        """Whether ``metrics`` holds its first scheduling time yet."""
        self.step_new_tokens = 0
        """Tokens its children kept in the step being processed."""
        self.pooled: list[float] | TensorData | None = None
        """A pooling request's vector (a token-wise task's rows), once its step is done."""
        self.held: list[CompletionState] = []
        """Children changed since the last output, which ``stream_interval`` held back."""
        self.tokens_held = 0
        """Tokens they kept since then."""
        self.spoken = False
        """Whether an output went out yet."""

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def record_step(self, now: float, num_new_tokens: int) -> None:
        metrics = self.metrics
        if num_new_tokens:
            if "first_token_time" not in metrics:
                metrics["first_token_time"] = now
                metrics["time_to_first_token"] = now - metrics["arrival_time"]
            metrics["last_token_time"] = now
        if self.finished:
            self.metrics["finished_time"] = now
            self.metrics["e2e_latency"] = now - self.metrics["arrival_time"]
            self.metrics["num_generation_tokens"] = float(
                sum(len(child.token_ids) for child in self.children)
            )

    def make_output(
        self, changed: list[CompletionState]
    ) -> RequestOutput | PoolingRequestOutput | None:
        """This step's output (None: nothing to say yet in FINAL_ONLY mode)."""
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.pooled is not None:
            return PoolingRequestOutput(
                self.request_id,
                PoolingOutput(pooled_tensor(self.pooled)),
                self.prompt_token_ids,
                self.finished,
                self.prompt,
                self._num_cached_tokens(),
            )
        reported = sorted(changed, key=lambda c: c.index)
        if kind is not RequestOutputKind.DELTA:
            reported = self.children
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(),
            outputs=[child.make_output(kind) for child in reported],
            finished=self.finished,
            num_cached_tokens=self._num_cached_tokens(),
            metrics=dict(self.metrics),
            lora_request=self.lora_request,
        )

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.output_kind is RequestOutputKind.DELTA and self.prompt_logprobs_sent:
            return None
        # Every child may report the prompt's logprobs; the most complete one wins.
        best = max(self.children, key=lambda c: (len(c.logprobs.prompt_rows), -c.index))
        prompt_logprobs = best.logprobs.prompt_logprobs()
        self.prompt_logprobs_sent = prompt_logprobs is not None
        return prompt_logprobs

    def _num_cached_tokens(self) -> int:
        """The prompt tokens the prefix cache served, the most any child was served. The
        children share the prompt's blocks: those admitted after the first find the blocks
        it computed, so the first child alone under-reports. vLLM gives an output the count
        of the child that completed it, for a final output the last to finish, which is a
        later-admitted child whenever the children finish together: the largest count."""
        return max(child.num_cached_tokens for child in self.children)


class OutputProcessor:
    """Turns ``EngineCoreOutput`` batches into ``RequestOutput`` objects for the user.

    ``tokenizer=None`` (skip_tokenizer_init) means no text: every ``text`` is "" and
    every ``Logprob.decoded_token`` None, as with ``detokenize=False``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}.")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._detokenizers = DetokenizerFactory(tokenizer) if tokenizer is not None else None
        self._token_texts = TokenTextCache(tokenizer) if tokenizer is not None else None
        self._parents: dict[str, _ParentRequest] = {}
        self._children: dict[str, tuple[_ParentRequest, CompletionState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_request_ids: list[str],
        arrival_time: float,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Track a user request whose samples run as ``child_request_ids`` in the core
        (with ``lora_request``'s adapter, which its outputs name).

        ``CompletionOutput.index`` of each sample is its position in ``child_request_ids``.
        """
        self._check_new_request(request_id, params, child_request_ids)
        texts = self._token_texts if params.detokenize else None
        children = []
        for index, child_id in enumerate(child_request_ids):
            detokenizer = None
            if self._detokenizers is not None:
                detokenizer = self._detokenizers.create(prompt_token_ids, params)
            logprobs = LogprobsProcessor(params, texts)
            children.append(CompletionState(index, child_id, params, detokenizer, logprobs))
        parent = _ParentRequest(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            children,
            arrival_time,
            lora_request,
        )
        self._parents[request_id] = parent
        for child in children:
            self._children[child.request_id] = (parent, child)

    def _check_new_request(
        self, request_id: str, params: SamplingParams, child_request_ids: list[str]
    ) -> None:
        if request_id in self._parents:
            raise ValueError(
                f"Request id {request_id!r} is already in use; give each request a unique id."
            )
        if not child_request_ids or len(set(child_request_ids)) != len(child_request_ids):
            raise ValueError(
                f"Request {request_id!r} needs one or more distinct child request ids, got "
                f"{child_request_ids!r}."
            )
        taken = [child_id for child_id in child_request_ids if child_id in self._children]
        if taken:
            raise ValueError(
                f"Child request id {taken[0]!r} of request {request_id!r} is already in use."
            )
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError(
                "stop strings need detokenized text, but there is no tokenizer or "
                "detokenize=False; use stop_token_ids instead."
            )

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Fold one engine-core step into the requests; outputs for unknown (aborted or
        already finished) child ids are ignored."""
        if self._token_texts is not None:
            self._token_texts.prefetch(self._logprob_token_ids(outputs))
        now = time.monotonic()
        changed: dict[_ParentRequest, list[CompletionState]] = {}
        reqs_to_abort: list[str] = []
        children = self._children
        for output in outputs:
            entry = children.get(output.req_id)
            if entry is None:
                continue
            parent, child = entry
            if not parent.scheduled and output.queued_seconds is not None:
                # Arrival and scheduling times share the host's monotonic clock.
                parent.metrics["first_scheduled_time"] = (
                    parent.metrics["arrival_time"] + output.queued_seconds
                )
                parent.scheduled = True
            if output.pooled is not None:
                parent.pooled = output.pooled
            num_tokens_before = len(child.token_ids)
            result = child.update(output)
            if result.stopped_by_string:
                reqs_to_abort.append(child.request_id)
            if child.finish_reason is not None:
                del children[child.request_id]
                parent.num_unfinished -= 1
            if result.changed:
                if parent in changed:
                    changed[parent].append(child)
                else:
                    changed[parent] = [child]
                parent.step_new_tokens += len(child.token_ids) - num_tokens_before
        request_outputs = []
        final_only = RequestOutputKind.FINAL_ONLY
        for parent, changed_children in changed.items():
            parent.record_step(now, parent.step_new_tokens)
            parent.tokens_held += parent.step_new_tokens
            parent.step_new_tokens = 0
            if parent.num_unfinished == 0:
                del self._parents[parent.request_id]
            elif parent.output_kind is final_only:
                continue  # nothing to say before it finishes
            elif self.stream_interval > 1 and self._hold(parent, changed_children):
                continue
            if parent.held:
                changed_children = _merged(parent.held, changed_children)
                parent.held = []
            parent.spoken, parent.tokens_held = True, 0
            request_output = parent.make_output(changed_children)
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _hold(self, parent: _ParentRequest, changed: list[CompletionState]) -> bool:
        """Whether ``stream_interval`` holds this unfinished parent's output back (keeping
        its changed children for the next one)."""
        if not parent.spoken or parent.tokens_held >= self.stream_interval:
            return False
        parent.held = _merged(parent.held, changed)
        return True

    def _logprob_token_ids(self, outputs: list[EngineCoreOutput]) -> Iterable[int]:
        for output in outputs:
            entry = self._children.get(output.req_id)
            if entry is not None and entry[1].logprobs.texts is not None:
                yield from row_token_ids(output.new_logprobs)
                yield from row_token_ids(output.new_prompt_logprobs)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget the given parent requests; returns their unfinished children's ids, which
        the engine core must abort. Unknown ids are ignored."""
        child_ids = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                if self._children.pop(child.request_id, None) is not None:
                    child_ids.append(child.request_id)
        return child_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)


def _merged(first: list[CompletionState], then: list[CompletionState]) -> list[CompletionState]:
    """Both lists' children, each once, in first-seen order."""
    return list(dict.fromkeys([*first, *then]))
