"""Free-running bf16 greedy parity with transformers (issue 5, "Correctness").

The issue asks for >= 99% agreement with transformers over the first 32 greedy tokens of a
batch of mixed-length prompts. Agreement is counted position by position, and after a
sequence's first mismatch the rest of it counts as mismatched (the two engines then
continue from different prefixes).

- Trained tiny Llama and Qwen3 (``free_running.PeriodicTask``: copy the token ``p - 1``
  back, ``p`` set by the prompt's tokens): logit margins are large, so bf16 rounding cannot
  flip a greedy choice and pagedlm must agree on >= 99% of tokens.
- Random models (tiny Llama/Qwen3 and the qwen3-0.6b shape): near-ties everywhere, so no
  two bf16 implementations agree at 99%. The yardstick is transformers against itself,
  two ways: eager attention vs sdpa, and sdpa with the prompts batched (left-padded) vs
  one at a time. pagedlm differs from transformers-sdpa-one-at-a-time in both ways at
  once (its own kernels, every prompt in one batch), so its agreement may fall below the
  weaker of the two yardsticks by at most ``max(0.03, 2 standard errors of the paired
  per-prompt difference)``: 0.03 is one of the 32 prompts diverging at its first token,
  and two standard errors make a false alarm ~2% likely when pagedlm is exactly as close
  to transformers as transformers is to itself. All numbers are printed.

GPU: ``python -m pytest -m cuda -s tests/cuda/test_greedy_free_running.py`` (prints the
numbers). The same harness on CPU: ``python -m pytest -m slow -s`` on this file.
"""

from __future__ import annotations

import json

import pytest
import torch
from free_running import (
    DEVICE,
    MIXED_LENGTHS,
    NEW_TOKENS,
    PeriodicTask,
    agreement,
    hf_greedy,
    pagedlm_greedy,
    per_sequence_agreement,
    random_prompts,
    standard_error,
    train_periodic_model,
)

TASK = PeriodicTask()
TRAIN_STEPS = 1000
BAR = 0.99
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(arch, device)`` -> directory of a model trained on ``TASK`` (cached)."""
    made = {}

    def make(arch: str, device: str):
        if (arch, device) not in made:
            path = tmp_path_factory.mktemp(f"periodic-{arch}-{device}")
            report = train_periodic_model(arch, path, TASK, steps=TRAIN_STEPS, device=device)
            print(f"\ntrained {arch} on {device}: {report}")
            # Fails loudly if training broke: the margins the parity check relies on need
            # a model that has learned the task (an untrained one has loss ~6). Seeds 0 and
            # 2 on CPU reach loss 0.001-0.007 and accuracy 0.9987-1.0.
            assert report.eval_loss < 0.05, report
            assert report.eval_accuracy >= 0.995, report
            made[arch, device] = path
        return made[arch, device]

    return make


def check_trained(path, dtype: str, device: str, platform: str | None, label: str) -> None:
    prompts = TASK.prompts()
    answers = [TASK.continuation(p) for p in prompts]
    reference = hf_greedy(path, prompts, _TORCH_DTYPES[dtype], "sdpa", device)
    eager = hf_greedy(path, prompts, _TORCH_DTYPES[dtype], "eager", device)
    ours = pagedlm_greedy(path, prompts, dtype, platform=platform)
    solved = agreement(reference, answers)
    ours_vs_ref = agreement(ours, reference)
    print(
        f"\n{label}: free-running agreement over {len(prompts)} prompts x {NEW_TOKENS} tokens: "
        f"pagedlm vs transformers sdpa {ours_vs_ref:.4f}; transformers eager vs sdpa "
        f"{agreement(eager, reference):.4f}; transformers solves the task {solved:.4f}"
    )
    assert solved >= 0.9, "the trained model no longer continues the period; see TrainReport"
    assert ours_vs_ref >= BAR, [
        (p[:8], o, r) for p, o, r in zip(prompts, ours, reference) if o != r
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trained_model_bf16_greedy_agrees_with_transformers(trained, arch) -> None:
    check_trained(trained(arch, DEVICE), "bfloat16", DEVICE, None, f"trained {arch} bf16")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trained_model_greedy_agrees_with_transformers_on_cpu(trained, arch, dtype) -> None:
    """The harness on the CPU platform (training ~1-1.5 min per arch on a busy 2-core CPU)."""
    check_trained(trained(arch, "cpu"), dtype, "cpu", "cpu", f"cpu: trained {arch} {dtype}")


def check_random(path, vocab_size: int, dtype: str, device: str, platform, label: str) -> None:
    prompts = random_prompts(vocab_size)
    torch_dtype = _TORCH_DTYPES[dtype]
    sdpa = hf_greedy(path, prompts, torch_dtype, "sdpa", device)
    # transformers against itself, two ways: another attention kernel, and the same kernel
    # with the prompts batched (left-padded: other GEMM shapes and masked attention).
    # pagedlm differs from ``sdpa`` in both ways at once.
    yardsticks = {
        "eager": hf_greedy(path, prompts, torch_dtype, "eager", device),
        "batched": hf_greedy(path, prompts, torch_dtype, "sdpa", device, batched=True),
    }
    ours = pagedlm_greedy(path, prompts, dtype, platform=platform)
    ours_f = per_sequence_agreement(ours, sdpa)
    self_f = {name: per_sequence_agreement(out, sdpa) for name, out in yardsticks.items()}
    mean = {name: sum(f) / len(f) for name, f in [("pagedlm", ours_f), *self_f.items()]}
    weakest = min(self_f, key=lambda name: mean[name])
    paired = [a - b for a, b in zip(ours_f, self_f[weakest])]
    margin = max(0.03, 2 * standard_error(paired))
    print(
        f"\n{label}: free-running agreement with transformers sdpa over {len(prompts)} prompts "
        f"x {NEW_TOKENS} tokens: pagedlm {mean['pagedlm']:.4f}; transformers eager "
        f"{mean['eager']:.4f}, transformers sdpa batched {mean['batched']:.4f} (allowed "
        f"shortfall below {weakest}: {margin:.4f}); pagedlm vs eager "
        f"{agreement(ours, yardsticks['eager']):.4f}"
    )
    assert mean["pagedlm"] >= mean[weakest] - margin


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_tiny_model_bf16_as_close_as_transformers_to_itself(tiny_checkpoint, arch) -> None:
    path = tiny_checkpoint(arch)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    check_random(path, vocab, "bfloat16", DEVICE, None, f"random tiny {arch} bf16")


@pytest.mark.cuda
def test_random_qwen3_0_6b_shape_bf16_as_close_as_transformers_to_itself(tmp_path) -> None:
    import transformers

    from pagedlm.benchmarks.shapes import BUILTIN_SHAPES

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**BUILTIN_SHAPES["qwen3-0.6b"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    del model
    check_random(
        tmp_path, config.vocab_size, "bfloat16", DEVICE, None, "random qwen3-0.6b shape bf16"
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_tiny_model_on_cpu(tiny_checkpoint, dtype) -> None:
    path = tiny_checkpoint("llama")
    check_random(path, 384, dtype, "cpu", "cpu", f"cpu: random tiny llama {dtype}")


def test_periodic_prompts_fix_their_continuation() -> None:
    prompts = TASK.prompts()
    assert [len(p) for p in prompts] == list(MIXED_LENGTHS)
    assert min(MIXED_LENGTHS) == 5 and max(MIXED_LENGTHS) == 300
    for prompt in prompts:
        period = TASK.period_of(prompt[0])
        assert period <= len(prompt)
        assert all(TASK.period_of(t) == period for t in prompt)
        assert len(set(prompt[:period])) == period
        full = prompt + TASK.continuation(prompt)
        assert all(full[i] == full[i - period] for i in range(period, len(full)))
    assert {TASK.period_of(p[0]) for p in prompts} == set(TASK.periods)
    assert TASK.prompts() == prompts  # seeded


def test_agreement_counts_a_row_only_up_to_its_first_mismatch() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(reference, reference) == 1.0
    assert per_sequence_agreement([[1, 2, 9, 4], [5, 6, 7, 8]], reference) == [0.5, 1.0]
    assert agreement([[9, 2, 3, 4], [5, 6, 7, 9]], reference) == (0 + 0.75) / 2
    with pytest.raises(ValueError):
        agreement([[1]], reference)
