"""Speculative decoding with every per-request feature in one batch: grammars (a mask per
drafted position), stop strings and stop tokens inside an accepted run, ``min_tokens``,
penalties, logit bias, allowed token ids and bad words (per position, the drafts counted as
outputs), logprobs of every emitted token, prompt logprobs; greedy outputs equal those
without speculation, and random requests run alongside."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams
from server.server_utils import write_chat_checkpoint

PROMPTS = [
    "Hello world, hello world, hello",
    "abcabcabcabc",
    "Café résumé",
    "short",
    "only a few tokens",
    "no two a in a row",
    "xyz",
]
A, B = 67, 68  # "a" and "b" in the checkpoint's byte-level vocabulary (checked below)
ALLOWED = [40, 41, 42, 43, 50, 101]


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0)
    return [
        SamplingParams(max_tokens=24, logprobs=3, prompt_logprobs=1, stop=["lo"], **greedy),
        SamplingParams(
            max_tokens=16, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+e"), **greedy
        ),
        SamplingParams(
            max_tokens=20,
            repetition_penalty=1.4,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            logit_bias={40: 3.0},
            min_tokens=6,
            **greedy,
        ),
        SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[101], **greedy),
        SamplingParams(max_tokens=12, allowed_token_ids=ALLOWED, logit_bias={7: 50.0}, **greedy),
        SamplingParams(
            max_tokens=10,
            allowed_token_ids=[A, B],
            logit_bias={A: 50.0},
            bad_words=["aa"],  # drafts say "aaaa"; every position blocks a after a
            **greedy,
        ),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=4),
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("spec-features")))


CPU_TOLERANCE = 1e-3
TF32_TOLERANCE = 1e-2
"""GPU kernels take float32 dots in TF32 (a 10-bit mantissa), and verification computes in
other shapes than decoding, so their logprobs part further there."""


def _summary(model_path: str, speculative_config=None, **engine_args) -> list:
    # float32 whatever the platform: in bf16 (the default where it is native, as on GPUs)
    # the verification and decode kernels round differently beyond the 1e-3 compared here.
    llm = LLM(
        model_path,
        max_model_len=128,
        dtype="float32",
        speculative_config=speculative_config,
        **engine_args,
    )
    on_cpu = llm.llm_engine.config.platform == "cpu"
    tolerance = CPU_TOLERANCE if on_cpu else TF32_TOLERANCE
    outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    spec = llm.llm_engine.engine_core.make_stats().spec_decoding
    if speculative_config is not None:
        assert spec is not None and spec.num_accepted_tokens > 0
    llm.llm_engine.shutdown()
    summary = []
    for out in outputs[:-1]:  # the random request differs once drafts change its draws
        completion = out.outputs[0]
        # Verification computes in other shapes than decoding: the last digits may differ.
        # In TF32 a near tie among the top-k may also swap which ids hold its last ranks
        # (seen on an H100: one row of 24, values 6e-3 apart), so there each row compares
        # its sampled token's logprob and the top-k values; on CPU also the ids.
        logprobs = completion.logprobs and [
            (
                pytest.approx(row[token].logprob, abs=tolerance),
                [
                    pytest.approx(v, abs=tolerance)
                    for v in sorted(lp.logprob for lp in row.values())
                ],
                sorted(row) if on_cpu else None,
            )
            for token, row in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        prompt = out.prompt_logprobs and [row and sorted(row) for row in out.prompt_logprobs]
        summary.append(
            (completion.token_ids, completion.text, completion.finish_reason, logprobs, prompt)
        )
    last = outputs[-1].outputs[0]
    assert 1 <= len(last.token_ids) <= 12
    return summary


@pytest.fixture(scope="module")
def expected(model_path: str) -> list:
    summary = _summary(model_path)
    assert summary[1][1] and set(summary[1][1]) <= set("abcde")  # the grammar held
    assert summary[4][0] and set(summary[4][0]) <= set(ALLOWED)  # bias cannot escape
    assert summary[5][1] == "ababababab"
    return summary


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_feature_gives_the_outputs_without_speculation(
    model_path: str, expected: list, async_scheduling: bool
) -> None:
    config = {
        "method": "draft_model",
        "model": model_path,  # the target drafts for itself: long accepted runs
        "num_speculative_tokens": 4,
    }
    assert _summary(model_path, config, async_scheduling=async_scheduling) == expected
