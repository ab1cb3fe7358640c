"""The batched bitmask in the sampler, the runner's row layout, and the compile cache."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pagedlm.sample import SamplingMetadata, SamplingRow
from pagedlm.sample.sampler import Sampler
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import GrammarBitmask
from pagedlm.structured_output.backend import GrammarSpec, StructuredOutputBackend
from pagedlm.structured_output.bitmask import apply_token_bitmask, unpack_bitmask
from pagedlm.structured_output.compiler import GrammarCompiler
from pagedlm.worker.model_runner import _batch_bitmask

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def _bitmask(allowed_rows: list[list[int] | None]) -> torch.Tensor:
    """Reference packing; ``None`` = unconstrained row (-1)."""
    width = (VOCAB + 31) // 32
    packed = np.full((len(allowed_rows), width), -1, dtype=np.int32)
    for row, allowed in enumerate(allowed_rows):
        if allowed is None:
            continue
        words = np.zeros(width, dtype=np.uint32)
        for token in allowed:
            words[token // 32] |= np.uint32(1 << (token % 32))
        packed[row] = words.view(np.int32)
    return torch.from_numpy(packed)


def test_unpack_matches_reference():
    allowed = [[0, 31, 32, 63, 69], None, []]
    mask = unpack_bitmask(_bitmask(allowed), VOCAB)
    assert mask.shape == (3, VOCAB)
    assert mask[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]  # 31, 63: sign bits
    assert mask[1].all() and not mask[2].any()
    with pytest.raises(ValueError, match="too few"):
        unpack_bitmask(_bitmask(allowed)[:, :2], 100)


def test_apply_leaves_unconstrained_rows_bit_identical():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    masked = apply_token_bitmask(logits, _bitmask([[5, 40], None, [69]]))
    assert torch.equal(logits, before), "the caller's logits are not modified"
    assert torch.equal(masked[1], logits[1])
    assert torch.isinf(masked[0]).sum() == VOCAB - 2 and masked[0, 40] == logits[0, 40]
    assert masked[2].argmax() == 69
    with pytest.raises(ValueError, match="one bitmask row per logits row"):
        apply_token_bitmask(logits, _bitmask([None]))


def test_sampler_respects_bitmask_for_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=2),
    ]
    generators = [None, torch.Generator().manual_seed(3), None, None]
    rows = [SamplingRow(p, g) for p, g in zip(params, generators)]
    metadata = SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))
    allowed = [[7, 8], [60, 61, 62], None, [1]]
    out = Sampler()(logits, metadata, _bitmask(allowed))
    tokens = out.sampled_token_ids.tolist()
    assert tokens[0] in (7, 8) and tokens[1] in (60, 61, 62) and tokens[3] == 1
    assert tokens[2] == logits[2].argmax().item()
    assert out.logprobs is not None
    # Logprobs describe the masked distribution: the only allowed token has probability 1.
    assert out.logprobs.logprobs[3, 0].item() == pytest.approx(0.0)


def test_runner_lays_out_rows_in_sampling_order():
    source = _bitmask([[1], [2]]).numpy()
    grammar = GrammarBitmask(req_ids=["b", "d"], bitmask=source)
    batch = _batch_bitmask(grammar, ["a", "b", "c", "d"])
    assert batch is not None and batch.shape == (4, source.shape[1])
    assert (batch[0] == -1).all() and (batch[2] == -1).all()
    assert torch.equal(batch[1], torch.from_numpy(source[0]))
    assert torch.equal(batch[3], torch.from_numpy(source[1]))
    in_order = _batch_bitmask(grammar, ["b", "d"])
    assert in_order is not None and torch.equal(in_order, torch.from_numpy(source))
    assert _batch_bitmask(None, ["a"]) is None
    assert _batch_bitmask(grammar, ["x"]) is None


class _SlowBackend(StructuredOutputBackend):
    """Compiles only when released, and counts compilations."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__(None, VOCAB, [0])
        self.release = threading.Event()
        self.compiled: list[GrammarSpec] = []

    @staticmethod
    def validate(spec):
        pass

    def compile(self, spec):
        assert self.release.wait(10)
        if spec.spec == "boom":
            raise RuntimeError("cannot compile boom")
        self.compiled.append(spec)
        return ("compiled", spec.spec)

    def make_matcher(self, compiled):
        raise NotImplementedError


def test_compiler_is_async_cached_and_does_not_cache_failures():
    backend = _SlowBackend()
    compiler = GrammarCompiler(lambda: backend, small_workers=2, cache_size=2)
    spec = GrammarSpec("regex", "a+")
    first = compiler.acquire(spec)
    assert not first.done(), "acquire returns before the grammar is compiled"
    assert compiler.acquire(GrammarSpec("regex", "a+")) is first
    failing = compiler.acquire(GrammarSpec("regex", "boom"))
    backend.release.set()
    assert first.result(5) == ("compiled", "a+")
    with pytest.raises(RuntimeError, match="boom"):
        failing.result(5)
    assert compiler.acquire(GrammarSpec("regex", "boom")) is not failing
    assert compiler.compile_now(spec) == ("compiled", "a+")
    assert backend.compiled.count(spec) == 1
    for text in ("b", "c"):  # evicts "a+" (least recently used) from a cache of 2
        compiler.compile_now(GrammarSpec("regex", text))
    compiler.compile_now(spec)
    assert backend.compiled.count(spec) == 2
    compiler.shutdown()
