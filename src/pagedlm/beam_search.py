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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pagedlm.outputs import Logprob
from pagedlm.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams per prompt, each up to ``max_tokens`` new tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        width = self.beam_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {width!r}.")
        if 2 * width > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width={width} needs {2 * width} candidates per beam and step, more "
                f"than the {MAX_LOGPROBS} logprobs a step reports; use at most "
                f"{MAX_LOGPROBS // 2}."
            )
        tokens = self.max_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {tokens!r}.")


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
    return beam.cum_logprob / (length**length_penalty)


StepFn = Callable[[list[list[int]], SamplingParams], list[dict[int, Logprob]]]
"""Prompts (token ids) -> the candidates of each one's next token (one engine step)."""


def search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    step: StepFn,
    eos_token_ids: set[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
    steps: Iterable[int] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for every prompt (token ids), ``step`` running the engine; ``steps``:
    ``range(params.max_tokens)`` or the same wrapped in a progress bar."""
    width = params.beam_width
    sampling = SamplingParams(
        max_tokens=1,
        logprobs=2 * width,
        temperature=params.temperature,
        ignore_eos=True,  # the end-of-sequence token is a candidate like any other
        detokenize=False,
    )

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos_token_ids, params.length_penalty)

    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens) if steps is None else steps:
        batch = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not batch:
            break
        candidates = step([beam.tokens for _, beam in batch], sampling)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), options in zip(batch, candidates, strict=True):
            for token_id, entry in options.items():
                child = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [options],
                    beam.cum_logprob + entry.logprob,
                )
                if token_id in eos_token_ids and not params.ignore_eos:
                    child.finish_reason = "stop"
                    done[i].append(child)
                elif len(child.tokens) >= max_model_len:
                    child.finish_reason = "length"
                    done[i].append(child)
                else:
                    grown[i].append(child)
        live = [sorted(beams, key=score, reverse=True)[:width] for beams in grown]
    outputs = []
    for i, beams in enumerate(live):
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(done[i] + beams, key=score, reverse=True)[:width]
        for beam in best:
            if decode is not None:
                beam.text = decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs
