"""``logprobs_mode`` (vLLM's engine flag): raw or processed, logprobs or logits. The
processed distribution is the one a token was drawn from (logit bias and penalties; for
random rows temperature and the filters too); the mode never changes what is sampled."""

from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.sample import Sampler, SamplingMetadata, SamplingRow
from pagedlm.sample.logprobs import LOGPROBS_MODES
from pagedlm.sample.topk_topp import FilterTensors, apply_filters

CPU = torch.device("cpu")
VOCAB = 32


def _batch() -> tuple[torch.Tensor, SamplingMetadata]:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=4, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.5, top_k=5, logprobs=6, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, logprobs=2, seed=2),
    ]
    rows = [SamplingRow(p, _generator(p.seed)) for p in params]
    return logits, SamplingMetadata.build(rows, VOCAB, CPU)


def _generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _expected_processed(logits: torch.Tensor) -> torch.Tensor:
    """What each row of ``_batch`` samples from, built by hand."""
    rows = [logits[0].clone(), logits[1] / 0.5, logits[2] / 1.3]
    rows[0][3] += 5.0
    processed = torch.stack(rows)
    filters = FilterTensors.build(
        min_p=[0.0, 0.0, 0.05], top_k=[-1, 5, -1], top_p=[1.0, 1.0, 0.8],
        vocab_size=VOCAB, device=CPU,
    )  # fmt: skip
    apply_filters(processed, filters)
    return processed


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_mode_reports_its_distribution_and_samples_the_same(mode: str) -> None:
    logits, metadata = _batch()
    reference = Sampler()(logits, _batch()[1])
    out = Sampler(logprobs_mode=mode)(logits, metadata)
    assert torch.equal(out.sampled_token_ids, reference.sampled_token_ids)
    source = _expected_processed(logits) if mode.startswith("processed") else logits
    values = source if mode.endswith("logits") else torch.log_softmax(source, dim=-1)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs.logprobs, values.gather(1, out.logprobs.token_ids))
    assert torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
    if mode == "processed_logprobs":  # top-k 5 leaves five tokens, the sixth is impossible
        assert math.isinf(out.logprobs.logprobs[1, 6]) and out.logprobs.logprobs[1, 5] > -1e9
        total = out.logprobs.logprobs[1, 1:6].exp().sum()
        torch.testing.assert_close(total, torch.tensor(1.0))


def test_an_unknown_mode_names_the_choices(chat_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"logprobs_mode='processed' is unknown; use one of"):
        EngineArgs(model=str(chat_checkpoint), logprobs_mode="processed").create_engine_config()


def _run(path: str, mode: str, **engine_args) -> list:
    llm = LLM(path, max_model_len=128, dtype="float32", logprobs_mode=mode, **engine_args)
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=10, logprobs=3, logit_bias={40: 4.0},
            repetition_penalty=1.3, ignore_eos=True,
        ),
        SamplingParams(temperature=0.8, top_k=4, max_tokens=10, logprobs=5, seed=3),
    ]  # fmt: skip
    outputs = llm.generate(["Hello world, hello world, hello", "abcabcabc"], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [out.outputs[0] for out in outputs]


def test_through_the_engine_the_tokens_stay_and_the_reported_values_change(
    chat_checkpoint,
) -> None:
    path = str(chat_checkpoint)
    runs = {mode: _run(path, mode) for mode in LOGPROBS_MODES}
    raw = runs["raw_logprobs"]
    for mode, outputs in runs.items():
        assert [o.token_ids for o in outputs] == [o.token_ids for o in raw], mode
    # top-k 4: the processed distribution has four tokens; a fifth alternative is impossible
    for row in runs["processed_logprobs"][1].logprobs:
        ranked = sorted(row.values(), key=lambda lp: lp.rank)
        assert math.isclose(sum(math.exp(lp.logprob) for lp in ranked[:4]), 1.0, rel_tol=1e-4)
        assert ranked[-1].logprob == float("-inf")
    raw_logits = runs["raw_logits"][0].logprobs[0]
    raw_logprobs = raw[0].logprobs[0]
    shifts = {round(raw_logits[t].logprob - raw_logprobs[t].logprob, 4) for t in raw_logprobs}
    assert len(shifts) == 1 and shifts != {0.0}, "logits differ from logprobs by one constant"


def test_speculative_verification_reports_the_same_processed_logprobs(chat_checkpoint) -> None:
    path = str(chat_checkpoint)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    plain = _run(path, "processed_logprobs")[0]
    verified = _run(path, "processed_logprobs", speculative_config=spec)[0]
    assert verified.token_ids == plain.token_ids
    for a, b in zip(verified.logprobs, plain.logprobs, strict=True):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-3)
