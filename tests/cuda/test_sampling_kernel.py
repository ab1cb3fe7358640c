"""The fused Gumbel-max sampling kernel: exact argmax for greedy rows, the softmax's
distribution for random rows, reproducible per seed, and the Sampler's use of it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton_env import DEVICE, ON_GPU

from pagedlm.sample import SamplingMetadata, SamplingRow, token_history_from_lists
from pagedlm.sample.sampler import Sampler
from pagedlm.sampling_params import SamplingParams
from pagedlm_cuda.kernels import sampling
from pagedlm_cuda.kernels.sampling import BLOCK_V, SPLIT_V, gumbel_sample, split_width


def seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def test_greedy_rows_take_the_argmax_lowest_index_on_ties() -> None:
    torch.manual_seed(0)
    vocab = SPLIT_V + 3000  # two programs per row: the winner may sit in either
    logits = torch.randn(4, vocab)
    logits[0, 5] = logits[0, 9000] = 50.0  # tie: the lower index wins
    logits[1, SPLIT_V + 10] = 50.0  # in the second split
    logits = logits.to(DEVICE, torch.bfloat16)
    noise_scale = torch.zeros(4, device=DEVICE)
    got = gumbel_sample(logits, None, noise_scale, seed(1)).cpu()
    assert got.tolist() == logits.float().argmax(dim=1).cpu().tolist()
    assert got[:2].tolist() == [5, SPLIT_V + 10]


def test_all_greedy_batch_without_a_seed_is_a_plain_argmax() -> None:
    torch.manual_seed(2)
    vocab = SPLIT_V + 500
    logits = torch.randn(3, vocab)
    logits[0, 7] = logits[0, SPLIT_V + 7] = 40.0  # tie across splits: the lower index
    logits[2] = float("-inf")  # nothing allowed: index 0, as torch.argmax
    logits = logits.to(DEVICE, torch.bfloat16)
    got = gumbel_sample(logits, torch.full((3,), 0.7, device=DEVICE), None, None).cpu()
    assert got.tolist() == logits.float().argmax(dim=1).cpu().tolist()
    assert got.tolist()[0] == 7 and got.tolist()[2] == 0


def test_random_rows_follow_the_softmax() -> None:
    # Under the interpreter every row costs ~14 ms, so CPU runs draw fewer samples.
    rows, tolerance = (20000, 0.015) if ON_GPU else (400, 0.08)
    temperature = 0.5
    row_logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    logits = row_logits.expand(rows, -1).contiguous().to(DEVICE)
    temperatures = torch.full((rows,), temperature, device=DEVICE)
    got = gumbel_sample(logits, temperatures, None, seed(123)).cpu()
    freq = torch.bincount(got, minlength=5).float() / rows
    probs = torch.softmax(row_logits / temperature, dim=0)  # [.016 .117 .861 .002 .043]
    # A frequency's standard error is at most 0.025 (400 draws) or 0.0035 (20000);
    # temperature 1 instead of 0.5 would move the top token's share by 0.27.
    assert (freq - probs).abs().max() < tolerance, (freq, probs)


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 300, device=DEVICE)
    first = gumbel_sample(logits, None, None, seed(7))
    assert torch.equal(first, gumbel_sample(logits, None, None, seed(7)))
    assert not torch.equal(first, gumbel_sample(logits, None, None, seed(8)))


def test_the_split_changes_neither_the_draws_nor_the_winner(monkeypatch) -> None:
    torch.manual_seed(5)
    vocab = 4 * BLOCK_V + 300
    logits = torch.randn(3, vocab)
    logits[2, 10] = logits[2, 3 * BLOCK_V + 10] = 30.0  # a greedy tie across programs
    logits = logits.to(DEVICE)
    noise_scale = torch.tensor([1.0, 1.0, 0.0], device=DEVICE)
    assert split_width(3, vocab) == BLOCK_V  # five programs per row
    narrow = gumbel_sample(logits, None, noise_scale, seed(9))
    monkeypatch.setattr(sampling, "MIN_PROGRAMS", 1)
    assert split_width(3, vocab) == SPLIT_V  # one program per row, five iterations
    wide = gumbel_sample(logits, None, noise_scale, seed(9))
    assert narrow.tolist() == wide.tolist()
    assert narrow[2].item() == 10


def test_split_width_keeps_a_gpu_busy() -> None:
    assert split_width(1, 128256) == BLOCK_V  # 63 programs of one iteration
    assert split_width(256, 151936) == SPLIT_V  # 2,560 programs of eight


class _Recorder:
    """Stands in for a kernel: records each launch's constexpr keywords, then launches."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.constexprs: set[tuple] = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.constexprs.add(tuple(sorted(kwargs.items())))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_one_compiled_kernel_serves_every_batch_size(monkeypatch) -> None:
    # A batch-dependent constexpr compiles a kernel the first time each batch size comes,
    # inside a serving run (W1 lost ~8% to it); the split is a runtime argument instead.
    first = _Recorder(sampling._gumbel_argmax_kernel)
    second = _Recorder(sampling._pick_kernel)
    monkeypatch.setattr(sampling, "_gumbel_argmax_kernel", first)
    monkeypatch.setattr(sampling, "_pick_kernel", second)
    # A launch of 8 programs makes the splits grow, so a few rows take each width (with
    # the GPU's 256, 64 rows were needed: ~10 s under the interpreter).
    monkeypatch.setattr(sampling, "MIN_PROGRAMS", 8)
    vocab = 6 * BLOCK_V + 100
    widths = set()
    for rows in (1, 3, 8):  # splits of 2048, 4096 and 16384: 7, 12 and 8 programs
        logits = torch.randn(rows, vocab, device=DEVICE)
        widths.add(split_width(rows, vocab))
        gumbel_sample(logits, None, None, seed(rows))
    assert len(widths) == 3  # the batches do take different splits
    assert len(first.constexprs) == 1 and len(second.constexprs) == 1


@pytest.mark.cuda  # run by the GPU's -m cuda, deselected (not skipped) on CPU
@pytest.mark.skipif(not ON_GPU, reason="counts compilations (the interpreter compiles none)")
def test_no_batch_size_compiles_the_sampler_again() -> None:
    from pagedlm.benchmarks.common import jit_compiles

    vocab = 128256  # 63 splits at batch 1, 32 (a multiple of 16) from batch 8
    gumbel_sample(torch.randn(1, vocab, device=DEVICE), None, None, seed(0))
    with jit_compiles() as compiled:
        for rows in (2, 5, 16, 40, 256):
            gumbel_sample(torch.randn(rows, vocab, device=DEVICE), None, None, seed(rows))
    assert compiled == []


@triton.jit
def _noise_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr, FAST: tl.constexpr):
    i = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + i, mask=i < n, other=0.5)
    tl.store(out_ptr + i, sampling._log2_gumbel(u, FAST), mask=i < n)


def test_noise_is_accurate_where_unlikely_tokens_win() -> None:
    # Gumbel noise -log(-log(u)) = -LN2 * log2_gumbel(u) - log(LN2). Near u = 1 (the
    # large noises) -log(u) is tiny and comes from its series; elsewhere from log2 (on a
    # GPU the hardware's approximate one, which the kernel uses).
    near_one = 1.0 - torch.logspace(-7.2, -1.5, 200, dtype=torch.float64)
    u = torch.cat([torch.linspace(1e-6, 0.97, 200, dtype=torch.float64), near_one])
    u32 = u.float()
    out = torch.empty(u.numel(), device=DEVICE)
    _noise_kernel[(1,)](u32.to(DEVICE), out, u.numel(), BLOCK=512, FAST=sampling._fast_log())
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    got = -ln2 * out.cpu().double() - torch.log(ln2)
    want = -torch.log(-torch.log(u32.double()))
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


@triton.jit
def _uniform_kernel(bits_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + i, sampling._uniform(bits))


def test_uniforms_stay_inside_zero_one() -> None:
    """``(k + 1/2) / 2^23`` for the top 23 bits ``k``: the ends of the bit range map to
    2^-24 and 1 - 2^-24, never 0 or 1 (no clamp needed before the logs)."""
    values = [0, 1 << 9, 0x7FFFFFFF, -1, -(1 << 9), 12345678]  # int32 views of the bits
    bits = torch.tensor(values + [0] * 2, dtype=torch.int32, device=DEVICE)
    out = torch.empty(8, device=DEVICE)
    _uniform_kernel[(1,)](bits, out, BLOCK=8)
    unsigned = [v % 2**32 for v in values]
    expected = [((b >> 9) + 0.5) / 2**23 for b in unsigned]
    assert out[:6].cpu().double().tolist() == expected
    assert out[0].item() == 2**-24 and out[3].item() == 1 - 2**-24


def test_all_minus_infinity_rows_take_index_zero() -> None:
    logits = torch.full((2, 2 * BLOCK_V + 5), float("-inf"), device=DEVICE)
    assert gumbel_sample(logits, None, None, None).tolist() == [0, 0]
    assert gumbel_sample(logits, None, None, seed(1)).tolist() == [0, 0]


def _metadata(params: list[SamplingParams], vocab: int, generators=None) -> SamplingMetadata:
    generators = generators or [None] * len(params)
    rows = [SamplingRow(p, g) for p, g in zip(params, generators)]
    return SamplingMetadata.build(rows, vocab, torch.device(DEVICE))


def test_sampler_uses_the_kernel_for_plain_random_batches() -> None:
    torch.manual_seed(2)
    vocab = 400
    logits = torch.randn(6, vocab, device=DEVICE)
    params = [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=0.8)] * 4
    calls = []

    def spy(*args):
        calls.append(args)
        return gumbel_sample(*args)

    out = Sampler(fused_random=spy)(logits, _metadata(params, vocab))
    assert len(calls) == 1
    assert out.sampled_token_ids[:2].tolist() == logits[:2].argmax(dim=1).tolist()
    assert out.sampled_token_ids.dtype == torch.int64


def test_sampler_uses_the_kernel_for_all_greedy_batches_with_penalties_applied() -> None:
    torch.manual_seed(4)
    vocab = 300
    logits = torch.randn(2, vocab, device=DEVICE)
    logits[0, 11] = logits[0].max() + 0.5  # the argmax, unless penalized
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=10.0), None),
        SamplingRow(SamplingParams(temperature=0.0), None),
    ]
    history = token_history_from_lists([[11], []], [[], []], torch.device(DEVICE))
    metadata = SamplingMetadata.build(rows, vocab, torch.device(DEVICE), token_history=history)
    calls = []

    def spy(*args):
        calls.append(args)
        return gumbel_sample(*args)

    out = Sampler(fused_random=spy)(logits, metadata)
    torch_out = Sampler()(logits, metadata)
    assert len(calls) == 1 and calls[0][3] is None  # no noise for an all-greedy batch
    assert out.sampled_token_ids.tolist() == torch_out.sampled_token_ids.tolist()
    assert out.sampled_token_ids[0].item() != 11


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 3}])
def test_sampler_keeps_the_torch_path_for_filters_and_seeds(params) -> None:
    torch.manual_seed(3)
    vocab = 400
    logits = torch.randn(3, vocab, device=DEVICE)
    sampling = [SamplingParams(temperature=0.8, **params)] * 3
    generators = None
    if "seed" in params:
        generators = [torch.Generator(device=DEVICE).manual_seed(3) for _ in range(3)]

    def refuse(*args):
        raise AssertionError("the fused kernel must not serve this batch")

    out = Sampler(fused_random=refuse)(logits, _metadata(sampling, vocab, generators))
    assert out.sampled_token_ids.shape == (3,)
