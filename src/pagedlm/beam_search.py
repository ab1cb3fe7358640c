"""Beam search over the engine (vLLM's ``LLM.beam_search``), as a loop of one-token steps.

Each step sends every live beam of every prompt to the engine as a prompt of its own
(``max_tokens=1``, ``logprobs=2 * beam_width``), so the engine batches them and its prefix
cache serves each beam's earlier tokens; each beam grows by each candidate token its step
reports, and each prompt keeps its ``beam_width`` best by score. A candidate that is the
end-of-sequence token finishes its beam (unless ``ignore_eos``); ``max_tokens`` steps, or
``max_model_len``, finish the rest. The result holds each prompt's ``beam_width`` best
finished beams, best first.

Score (vLLM's): the beam's cumulative logprob divided by its length to the power
``length_penalty``, the length counting the prompt and not a final end-of-sequence token.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedlm.engine.concurrent_requests import final_output, gather_all
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams per prompt, each up to ``max_tokens`` new tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    """vLLM's field, kept for its signature: beam search has no stop strings to include."""

    def __post_init__(self) -> None:
        width = self.beam_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {width!r}.")
        tokens = self.max_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {tokens!r}.")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int | float):
            raise ValueError(f"length_penalty must be a number, got {penalty!r}.")
        if not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}.")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt's ids then the generated ones, ``logprobs``
    one dict per generated token, ``text`` the decoded ``tokens`` (prompt included)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """The ``beam_width`` best beams, best first."""


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_token_ids:
        length -= 1
    try:
        return beam.cum_logprob / (length**length_penalty)
    except (OverflowError, ZeroDivisionError):  # length ** length_penalty is past a float
        return 0.0 if length_penalty > 0 else -math.inf  # the limits of the score


class BeamSearch:
    """The search's state between engine steps: ``pending()`` gives the live beams' token
    lists to step, ``advance`` takes each one's next-token candidates, ``result()`` the
    outputs once ``done``. Drivers: ``search`` (a synchronous step function) and
    ``AsyncLLM.beam_search``."""

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        eos_token_ids: set[int],
        max_model_len: int,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        width = params.beam_width
        if 2 * width > max_logprobs:
            raise ValueError(
                f"beam_width={width} needs {2 * width} candidates per beam and step, more "
                f"than the engine's max_logprobs={max_logprobs}; use at most "
                f"{max_logprobs // 2}, or start the engine with a larger max_logprobs."
            )
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampling = SamplingParams(
            max_tokens=1,
            logprobs=2 * params.beam_width,
            temperature=params.temperature,
            ignore_eos=True,  # the end-of-sequence token is a candidate like any other
            detokenize=False,
        )
        self.num_steps = 0
        self._live = [[BeamSearchSequence(list(p))] for p in prompts]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._batch: list[tuple[int, BeamSearchSequence]] = []

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_ids, self.params.length_penalty)

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not any(self._live)

    def pending(self) -> list[list[int]]:
        self._batch = [(i, beam) for i, beams in enumerate(self._live) for beam in beams]
        return [beam.tokens for _, beam in self._batch]

    def advance(self, candidates: Sequence[dict[int, Logprob]]) -> None:
        """One step: ``candidates[j]``, token id -> logprob, for ``pending()[j]``."""
        params = self.params
        grown: list[list[BeamSearchSequence]] = [[] for _ in self._live]
        for (i, beam), options in zip(self._batch, candidates, strict=True):
            for token_id, entry in options.items():
                child = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [options],
                    beam.cum_logprob + entry.logprob,
                )
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    child.finish_reason = "stop"
                    self._done[i].append(child)
                elif len(child.tokens) >= self.max_model_len:
                    child.finish_reason = "length"
                    self._done[i].append(child)
                else:
                    grown[i].append(child)
        width = params.beam_width
        self._live = [sorted(beams, key=self.score, reverse=True)[:width] for beams in grown]
        self.num_steps += 1

    def result(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """Each prompt's ``beam_width`` best beams, best first (texts decoded with
        ``decode`` when given)."""
        outputs = []
        for done, live in zip(self._done, self._live, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            best = sorted(done + live, key=self.score, reverse=True)[: self.params.beam_width]
            if decode is not None:
                for beam in best:
                    beam.text = decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs


StepFn = Callable[[list[list[int]], SamplingParams], list[dict[int, Logprob]]]
"""Prompts (token ids) -> the candidates of each one's next token (one engine step)."""


def search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    step: StepFn,
    eos_token_ids: set[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
    on_step: Callable[[], None] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> list[BeamSearchOutput]:
    """Beam search for every prompt (token ids), ``step`` running the engine;
    ``on_step`` is called after each step (a progress bar)."""
    state = BeamSearch(prompts, params, eos_token_ids, max_model_len, max_logprobs)
    while not state.done:
        state.advance(step(state.pending(), state.sampling))
        if on_step is not None:
            on_step()
    return state.result(decode)


AsyncStep = Callable[[list[list[int]], SamplingParams, int], Awaitable[list[dict[int, Logprob]]]]
"""(beams' token ids, sampling, step number) -> each beam's candidates (asynchronously)."""


async def search_async(
    prompt_ids: list[int],
    params: BeamSearchParams,
    step: AsyncStep,
    eos_token_ids: set[int],
    max_model_len: int,
    max_logprobs: int,
) -> BeamSearchOutput:
    """``search`` for one prompt with an asynchronous step (a server's engine)."""
    state = BeamSearch([prompt_ids], params, eos_token_ids, max_model_len, max_logprobs)
    while not state.done:
        state.advance(await step(state.pending(), state.sampling, state.num_steps))
    (result,) = state.result(None)
    return result


def beam_prompt(tokens: list[int], cache_salt: str | None) -> dict[str, Any]:
    """One beam's engine prompt: its tokens, with the searched prompt's ``cache_salt`` (a
    beam shares prefix-cache blocks only with requests of the same salt, as its prompt)."""
    if cache_salt is None:
        return {"prompt_token_ids": tokens}
    return {"prompt_token_ids": tokens, "cache_salt": cache_salt}


def engine_step(
    generate: Callable[..., AsyncIterator[RequestOutput]],
    request_id: str,
    lora_request: Any = None,
    cache_salt: str | None = None,
) -> AsyncStep:
    """An ``AsyncStep`` over an engine's ``generate(prompt, params, request_id, priority,
    lora_request)``: every beam a request of its own, all at once (``gather_all``: an
    error, or the caller leaving, aborts the rest), with the searched prompt's
    ``cache_salt``. The beams' ids are ``request_id`` plus a random part of this
    search's, so two searches given one id (a client's reused ``X-Request-Id``) never
    share a beam's id, as in vLLM."""
    search_id = f"{request_id}-{uuid.uuid4().hex[:16]}"

    async def last(tokens: list[int], sampling: SamplingParams, beam_id: str) -> RequestOutput:
        prompt = beam_prompt(tokens, cache_salt)
        final = await final_output(generate(prompt, sampling, beam_id, 0, lora_request))
        if final is None:
            raise ValueError(f"beam request {beam_id} was aborted before it finished.")
        return final

    async def step(
        beams: list[list[int]], sampling: SamplingParams, number: int
    ) -> list[dict[int, Logprob]]:
        final_only = sampling.clone()
        final_only.output_kind = RequestOutputKind.FINAL_ONLY
        finals = await gather_all(
            last(tokens, final_only, f"{search_id}-beam{number}-{j}")
            for j, tokens in enumerate(beams)
        )
        return [final.outputs[0].logprobs[0] for final in finals]  # type: ignore[index]

    return step


def request_output(
    request_id: str,
    prompt: str | None,
    prompt_ids: list[int],
    result: BeamSearchOutput,
    decode: Callable[[list[int]], str] | None,
) -> RequestOutput:
    """One finished output whose samples are the beams, best first: each one's generated
    tokens (after the prompt), their text, cumulative logprob and logprobs."""
    outputs = []
    for index, beam in enumerate(result.sequences):
        generated = beam.tokens[len(prompt_ids) :]
        outputs.append(
            CompletionOutput(
                index,
                decode(generated) if decode is not None else "",
                generated,
                beam.cum_logprob,
                beam.logprobs,
                beam.finish_reason,
                beam.stop_reason,
            )
        )
    return RequestOutput(request_id, prompt, prompt_ids, None, outputs, finished=True)
