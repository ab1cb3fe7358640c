"""The rejection sampler: greedy verification is the longest matching prefix plus one token,
random verification keeps the target distribution (a chi-square test over 20k requests of a
tiny-vocabulary model, which a sampler that accepts every draft fails), seeds are honoured,
and logprobs describe each emitted token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.rejection_sampler import RejectionSampler
from pagedlm.sample.row import SamplingRow
from pagedlm.sampling_params import SamplingParams

VOCAB = 8
NUM_SAMPLES = 20_000


def _metadata(params: list[SamplingParams], generators=None, seed: int = 0) -> SamplingMetadata:
    generators = generators or [None] * len(params)
    rows = [SamplingRow(p, g) for p, g in zip(params, generators, strict=True)]
    default = torch.Generator().manual_seed(seed)
    return SamplingMetadata.build(rows, VOCAB, torch.device("cpu"), default_generator=default)


def _run(logits, params, drafts, num_rows, num_verified, **kwargs):
    sampler = kwargs.pop("sampler", RejectionSampler())
    metadata = _metadata(params, kwargs.pop("generators", None), kwargs.pop("seed", 0))
    return sampler(
        logits,
        metadata,
        torch.tensor(drafts, dtype=torch.int64),
        np.array(num_rows),
        torch.tensor(num_verified, dtype=torch.int64),
        **kwargs,
    )


def test_greedy_accepts_the_longest_matching_prefix_then_emits_the_argmax() -> None:
    argmax = [3, 5, 1, 6]
    logits = torch.full((8, VOCAB), -1.0)
    for row, token in enumerate(argmax + argmax):
        logits[row, token] = 2.0
    greedy = [SamplingParams(temperature=0.0)] * 8
    # Request 0: drafts 3, 5 right, 0 wrong -> 3, 5, then row 2's argmax 1.
    # Request 1: all three right -> 3, 5, 1 and the bonus row's 6; only 2 verified -> 3, 5, 1.
    out = _run(logits, greedy, [3, 5, 0, 0, 3, 5, 1, 0], [4, 4], [3, 3])
    assert out.num_emitted.tolist() == [3, 4]
    assert out.token_ids[0, :3].tolist() == [3, 5, 1]
    assert out.token_ids[1].tolist() == [3, 5, 1, 6]
    out = _run(logits, greedy, [3, 5, 0, 0, 3, 5, 1, 0], [4, 4], [3, 2])
    assert out.token_ids[1, :3].tolist() == [3, 5, 1] and out.num_emitted.tolist() == [3, 3]
    # Requests of different row counts (request 1: one draft, then its bonus row).
    out = _run(logits[:6], greedy[:6], [3, 5, 0, 0, 3, 0], [4, 2], [3, 1])
    assert out.num_emitted.tolist() == [3, 2]
    assert out.token_ids[0, :3].tolist() == [3, 5, 1] and out.token_ids[1, :2].tolist() == [3, 5]


def _tiny_model_distributions() -> tuple[torch.Tensor, int]:
    """A tiny random language model's next-token logits after a prompt and after its
    likeliest token (the two rows a verification of one draft sees), and that token."""
    generator = torch.Generator().manual_seed(3)
    embed = torch.randn(VOCAB, 16, generator=generator)
    mix = torch.randn(16, 16, generator=generator) * 0.5
    head = torch.randn(16, VOCAB, generator=generator)

    def next_logits(tokens: list[int]) -> torch.Tensor:
        weights = torch.arange(1.0, len(tokens) + 1)  # later tokens count more
        context = (embed[tokens] * weights[:, None]).sum(0) / weights.sum()
        return torch.tanh(context @ mix + context) @ head

    prompt = [1, 4, 2]
    first = next_logits(prompt)
    draft = int(first.argmax())
    return torch.stack([first, next_logits([*prompt, draft])]), draft


def _chi_square_ok(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the counts of ``samples`` fit ``probs`` at the 0.1% level."""
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    statistic = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the 99.9% normal quantile; Wilson-Hilferty gives chi-square's
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical


class _AcceptsEveryDraft(RejectionSampler):
    """The wrong sampler the distribution test must catch."""

    def __call__(self, logits, metadata, draft_token_ids, num_rows, num_verified, **kwargs):
        out = super().__call__(logits, metadata, draft_token_ids, num_rows, num_verified, **kwargs)
        tokens = out.token_ids.clone()
        tokens[:, 0] = draft_token_ids.view(len(num_rows), -1)[:, 0]
        return out._replace(token_ids=tokens)


def _first_tokens(sampler: RejectionSampler, draft_probs: bool, temperature: float):
    """20k requests verifying one draft each: (emitted tokens, counts, [p0, p1], drafts)."""
    logits, draft = _tiny_model_distributions()
    p = torch.softmax(logits / temperature, dim=-1)
    rows = logits.repeat(NUM_SAMPLES, 1)
    params = [SamplingParams(temperature=temperature)] * (2 * NUM_SAMPLES)
    kwargs = {}
    drafts = torch.full((NUM_SAMPLES,), draft)
    if draft_probs:  # a proposer that samples its drafts from a q unlike p
        q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)), -1)
        drafts = torch.multinomial(q, NUM_SAMPLES, True, generator=torch.Generator().manual_seed(5))
        kwargs["draft_probs"] = q.repeat(2 * NUM_SAMPLES, 1)
    draft_rows = torch.stack([drafts, torch.zeros_like(drafts)], 1).view(-1).tolist()
    out = _run(
        rows, params, draft_rows, [2] * NUM_SAMPLES, [1] * NUM_SAMPLES, sampler=sampler, **kwargs
    )
    return out.token_ids, out.num_emitted, p, drafts


@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_random_verification_keeps_the_target_distribution(
    draft_probs: bool, temperature: float
) -> None:
    tokens, emitted, p, _ = _first_tokens(RejectionSampler(), draft_probs, temperature)
    assert _chi_square_ok(tokens[:, 0], p[0])
    # After an accepted draft the next token follows that position's distribution.
    accepted = emitted == 2
    assert 0 < int(accepted.sum()) < NUM_SAMPLES
    assert _chi_square_ok(tokens[accepted, 1], p[1])


def test_the_distribution_test_fails_a_sampler_that_accepts_every_draft() -> None:
    tokens, _, p, _ = _first_tokens(_AcceptsEveryDraft(), False, 1.0)
    assert not _chi_square_ok(tokens[:, 0], p[0])


def test_seeded_rows_repeat_and_logprobs_describe_the_emitted_tokens() -> None:
    logits, draft = _tiny_model_distributions()
    rows = logits.repeat(4, 1)
    params = [SamplingParams(temperature=1.0, seed=7, logprobs=2)] * 8
    results = []
    for _ in range(2):
        generators = []
        for _ in range(4):  # one generator per request, shared by its two rows
            generator = torch.Generator().manual_seed(7)
            generators += [generator, generator]
        out = _run(rows, params, [draft, 0] * 4, [2] * 4, [1] * 4, generators=generators, seed=1)
        results.append(out)
    assert torch.equal(results[0].token_ids, results[1].token_ids)
    out = results[0]
    logprobs = torch.log_softmax(rows, dim=-1)
    emitted = out.token_ids.view(-1)
    assert torch.equal(out.logprobs.token_ids[:, 0], emitted)
    assert torch.allclose(out.logprobs.logprobs[:, 0], logprobs.gather(1, emitted[:, None])[:, 0])
