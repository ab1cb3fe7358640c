"""Sampler behaviour: greedy, support filters, seeding, bias, min_tokens, statistics."""

from __future__ import annotations

import pytest
import torch

from pagedlm.sample import Sampler, SamplingMetadata, SamplingRow, token_history_from_lists
from pagedlm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_row(
    num_output: int = 0, generator: torch.Generator | None = None, **params
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), generator, num_output)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], default_seed: int | None = 0
) -> torch.Tensor:
    generator = None if default_seed is None else torch.Generator().manual_seed(default_seed)
    # Every row's history: prompt [0], outputs [1] * num_output_tokens.
    history = token_history_from_lists(
        [[0]] * len(rows), [[1] * row.num_output_tokens for row in rows], CPU
    )
    metadata = SamplingMetadata.build(rows, logits.shape[1], CPU, generator, history)
    return Sampler()(logits, metadata).sampled_token_ids


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0  # tie: lowest index wins
    before = logits.clone()
    rows = [make_row(temperature=0.0) for _ in range(5)] + [make_row(temperature=1e-6)]
    assert SamplingMetadata.build(rows, 50, CPU).all_greedy  # 1e-6 counts as greedy
    sampled = sample(logits, rows)
    assert sampled.dtype == torch.int64
    assert torch.equal(sampled, logits.argmax(dim=-1))
    assert sampled[2] == 7
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    before = logits.clone()
    rows = [
        make_row(temperature=0.0) if i % 2 else make_row(temperature=0.8, top_p=0.9, top_k=5)
        for i in range(8)
    ]
    sampled = sample(logits, rows)
    assert torch.equal(sampled[1::2], logits[1::2].argmax(dim=-1))
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_accepted() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 20).to(torch.bfloat16)
    sampled = sample(logits, [make_row(temperature=0.0)] * 3)
    assert torch.equal(sampled, logits.float().argmax(dim=-1))


def _top_p_support(probs: torch.Tensor, top_p: float) -> set[int]:
    """Reference: most likely tokens, one at a time, until their mass reaches top_p."""
    kept, mass = set(), 0.0
    for token in torch.argsort(probs, descending=True).tolist():
        kept.add(token)
        mass += probs[token].item()
        if mass >= top_p:
            break
    return kept


def _sampled_support(logits_row: torch.Tensor, num_samples: int = 400, **params) -> set[int]:
    logits = logits_row.expand(num_samples, -1).clone()
    rows = [make_row(**params) for _ in range(num_samples)]
    return set(sample(logits, rows, default_seed=3).tolist())


@pytest.fixture
def logits_row() -> torch.Tensor:
    torch.manual_seed(4)
    return torch.randn(32) * 2.0


def test_top_k_restricts_support(logits_row: torch.Tensor) -> None:
    allowed = set(logits_row.topk(5).indices.tolist())
    support = _sampled_support(logits_row, top_k=5)
    assert support <= allowed
    assert len(support) > 1


def test_top_k_one_is_greedy(logits_row: torch.Tensor) -> None:
    assert _sampled_support(logits_row, top_k=1, temperature=1.5) == {int(logits_row.argmax())}


def test_top_k_at_least_vocab_is_off(logits_row: torch.Tensor) -> None:
    metadata = SamplingMetadata.build([make_row(top_k=32), make_row(top_k=500)], 32, CPU)
    assert metadata.filters.top_k is None


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top_p_restricts_support(logits_row: torch.Tensor, temperature: float) -> None:
    allowed = _top_p_support((logits_row / temperature).softmax(-1), 0.6)
    support = _sampled_support(logits_row, top_p=0.6, temperature=temperature)
    assert support <= allowed
    assert len(support) > 1


def test_tiny_top_p_keeps_the_most_likely_token(logits_row: torch.Tensor) -> None:
    # In float32 1 - 1e-9 == 1.0: without a guard the whole row would be dropped.
    assert _sampled_support(logits_row, top_p=1e-9) == {int(logits_row.argmax())}


def test_min_p_restricts_support_after_temperature(logits_row: torch.Tensor) -> None:
    probs = (logits_row / 0.7).softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    support = _sampled_support(logits_row, min_p=0.2, temperature=0.7)
    assert support <= allowed
    assert len(support) > 1


def test_top_k_then_top_p_combined(logits_row: torch.Tensor) -> None:
    top = logits_row.topk(8)
    renormalized = torch.full_like(logits_row, float("-inf"))
    renormalized[top.indices] = top.values
    allowed = _top_p_support(renormalized.softmax(-1), 0.7)
    assert allowed < set(top.indices.tolist())
    support = _sampled_support(logits_row, top_k=8, top_p=0.7)
    assert support <= allowed
    assert len(support) > 1


def test_filters_apply_only_to_rows_that_set_them(logits_row: torch.Tensor) -> None:
    kinds = [{"top_k": 2}, {"top_p": 0.3}, {"min_p": 0.5}, {}]
    rows = [make_row(**kinds[i % 4]) for i in range(800)]
    sampled = sample(logits_row.expand(800, -1).clone(), rows, default_seed=10)
    probs = logits_row.softmax(-1)
    supports = [set(sampled[i::4].tolist()) for i in range(4)]
    assert supports[0] <= set(logits_row.topk(2).indices.tolist())
    assert supports[1] <= _top_p_support(probs, 0.3)
    assert supports[2] <= set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert len(supports[3]) > 8  # unfiltered rows keep the whole vocabulary


def test_temperature_sampling_matches_softmax() -> None:
    """Chi-square of 20000 draws against softmax(logits / T), 7 degrees of freedom."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    temperature, num_samples = 0.7, 20000
    rows = [make_row(temperature=temperature) for _ in range(num_samples)]
    sampled = sample(logits.expand(num_samples, -1).clone(), rows, default_seed=5)
    observed = torch.bincount(sampled, minlength=8).double()
    expected = (logits / temperature).softmax(-1).double() * num_samples
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # p < 1e-5 for chi2(7) beyond 35; a biased sampler lands in the hundreds here.
    assert chi_square < 35.0


def _seeded_run(rows_before: int, rows_after: int, steps: int = 6) -> list[int]:
    """Sample the seed-7 row for several steps, surrounded by other rows."""
    torch.manual_seed(6)
    step_logits = [torch.randn(64) for _ in range(steps)]
    target = seeded(7)
    others = [seeded(100 + i) for i in range(rows_before + rows_after)]
    tokens = []
    for logits_row in step_logits:
        filler = [
            make_row(seed=100 + i, generator=g, top_p=0.8)
            if i % 3 == 0
            else make_row(temperature=0.0 if i % 3 == 1 else 1.3, top_k=4, repetition_penalty=1.1)
            for i, g in enumerate(others)
        ]
        row = make_row(seed=7, generator=target, top_p=0.95, top_k=20, temperature=0.9)
        rows = [*filler[:rows_before], row, *filler[rows_before:]]
        logits = torch.randn(len(rows), 64)
        logits[rows_before] = logits_row
        tokens.append(int(sample(logits, rows, default_seed=None)[rows_before]))
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    alone = _seeded_run(0, 0)
    assert _seeded_run(3, 0) == alone
    assert _seeded_run(2, 5) == alone
    assert _seeded_run(0, 4) == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, 1000)

    def run(seed: int) -> list[int]:
        generator = seeded(seed)
        return [
            int(sample(logits, [make_row(seed=seed, generator=generator)])[0]) for _ in range(8)
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(64, 1000)
    rows = [make_row() for _ in range(64)]
    metadata = SamplingMetadata.build(rows, 1000, CPU, seeded(8))
    first = Sampler()(logits, metadata).sampled_token_ids
    second = Sampler()(logits, metadata).sampled_token_ids
    assert len(set(first.tolist())) > 40
    assert not torch.equal(first, second)


def test_logit_bias_forces_and_forbids_tokens() -> None:
    torch.manual_seed(9)
    logits = torch.randn(3, 30)
    best = int(logits[1].argmax())
    rows = [
        make_row(temperature=1.0, logit_bias={11: 100.0}),
        make_row(temperature=0.0, logit_bias={best: -100.0}),
        make_row(temperature=0.0),
    ]
    sampled = sample(logits, rows)
    assert sampled[0] == 11
    second_best = logits[1].topk(2).indices[1]
    assert sampled[1] == second_best
    assert sampled[2] == logits[2].argmax()


def test_allowed_token_ids_keep_only_those_tokens_whatever_the_bias() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    allowed = [4, 17, 25]
    rows = [
        make_row(temperature=0.0, allowed_token_ids=allowed),
        make_row(temperature=1.0, allowed_token_ids=allowed, logit_bias={0: 100.0}, seed=1),
        make_row(temperature=0.0),
        make_row(temperature=0.0, allowed_token_ids=[9]),
    ]
    for _ in range(20):
        sampled = sample(logits, rows).tolist()
        assert sampled[0] == allowed[int(logits[0, allowed].argmax())]
        assert sampled[1] in allowed
        assert sampled[2] == int(logits[2].argmax())
        assert sampled[3] == 9
    with pytest.raises(ValueError, match="allowed_token_ids names a token id outside"):
        SamplingMetadata.build([make_row(allowed_token_ids=[30])], 30, CPU)
    with pytest.raises(ValueError, match="allowed_token_ids is empty"):
        make_row(allowed_token_ids=[])


def test_bad_words_mask_one_token_always_and_the_last_of_several_after_the_others() -> None:
    logits = torch.zeros(4, 20)
    logits[:, 7] = 9.0  # the one-token bad word
    logits[:, 5] = 8.0  # the last token of the bad word [3, 4, 5]
    logits[:, 6] = 1.0

    def row(outputs: list[int]) -> tuple[SamplingRow, list[int]]:
        params = SamplingParams(temperature=0.0)
        params.bad_words_token_ids = [[7], [3, 4, 5], [4, 5]]  # as the engine resolves them
        return SamplingRow(params, None, len(outputs)), outputs

    rows, outputs = zip(
        row([1, 2, 3, 4]),  # ends with 3 4: 5 masked
        row([1, 3, 9]),  # neither prefix: 5 stays
        row([4]),  # ends with 4 ([4, 5]): 5 masked; [3, 4] needs two outputs
        row([]),  # no outputs: only the one-token word
        strict=True,
    )
    history = token_history_from_lists([[0]] * 4, list(outputs), CPU)
    metadata = SamplingMetadata.build(list(rows), 20, CPU, token_history=history)
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
    assert sampled == [6, 5, 6, 5]


def test_logit_bias_outside_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        SamplingMetadata.build([make_row(logit_bias={30: 1.0})], 30, CPU)


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    eos, stop_id = 5, 9
    logits = torch.zeros(4, 12)
    logits[:, eos] = 50.0
    logits[:, stop_id] = 40.0
    logits[:, 2] = 30.0

    def row(num_output: int, **params) -> SamplingRow:
        r = make_row(num_output, min_tokens=3, stop_token_ids=[stop_id], **params)
        r.params.all_stop_token_ids = {eos, stop_id}
        return r

    rows = [
        row(0, temperature=0.0),
        row(2, temperature=1.0, logit_bias={eos: 10.0}),  # bias cannot unmask a stop token
        row(3, temperature=0.0),
        make_row(temperature=0.0),
    ]
    sampled = sample(logits, rows)
    assert sampled.tolist() == [2, 2, eos, eos]


def test_min_tokens_yields_only_to_a_grammar_that_left_nothing_else() -> None:
    """A grammar row (its mask already applied: -inf but for its stop tokens) keeps its
    stops; other rows under min_tokens never do, and each row is checked once."""
    from pagedlm.sample.logit_bias import LogitAdjustments, apply_logit_adjustments
    from pagedlm.sampling_params import StructuredOutputsParams

    eos, stop_id = 5, 9
    logits = torch.zeros(3, 12)
    logits[0] = float("-inf")  # an ended grammar: only its stop tokens left
    logits[0, [eos, stop_id]] = 1.0
    logits[1, [eos, stop_id]] = 1.0  # a grammar with other tokens still open
    logits[2] = float("-inf")  # no grammar (such a request is refused when added)
    logits[2, [eos, stop_id]] = 1.0
    grammar = StructuredOutputsParams(regex="a*")
    rows = [make_row(0, min_tokens=3, structured_outputs=grammar) for _ in range(2)]
    rows.append(make_row(0, min_tokens=3))
    for row in rows:
        row.params.all_stop_token_ids = {eos, stop_id}
    adjustments = LogitAdjustments.build(rows, 12, CPU)
    assert adjustments is not None and adjustments.stop_row_set.tolist() == [0, 1]
    apply_logit_adjustments(logits, adjustments)
    assert logits[0, [eos, stop_id]].tolist() == [1.0, 1.0]
    assert torch.isneginf(logits[1:, [eos, stop_id]]).all()
