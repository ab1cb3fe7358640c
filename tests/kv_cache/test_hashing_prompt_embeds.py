"""Block hashes of prompts given as embeddings: keyed by each block's rows, so the same
rows hit, other rows (with the same placeholder ids) or real ids never do, and a shared
first run of rows shares its blocks. The rows also survive the step protocol's and the
engine core's wire formats."""

from __future__ import annotations

import torch

from pagedlm.core.request import Request
from pagedlm.engine.messages import request_from_wire, request_to_wire
from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.multimodal.tensors import from_tensor_data, to_tensor_data
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import CachedRequestData, NewRequestData, SchedulerOutput
from pagedlm.step.codec import decode, encode

BLOCK = 4


def request(rows: torch.Tensor | None, num_tokens: int = 10) -> Request:
    data = None if rows is None else to_tensor_data(rows)
    return Request("r", [0] * num_tokens, SamplingParams(max_tokens=4), prompt_embeds=data)


def hashes(rows: torch.Tensor | None, num_tokens: int = 10) -> list[bytes]:
    return update_block_hashes(request(rows, num_tokens), BLOCK)


def test_equal_rows_hash_equal_and_other_rows_or_ids_do_not():
    rows = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    assert hashes(rows) == hashes(rows.clone())
    assert len(hashes(rows)) == 2
    other = rows.clone()
    other[5] += 1.0  # inside the second block
    first, second = hashes(rows), hashes(other)
    assert first[0] == second[0] and first[1] != second[1]
    assert not set(hashes(rows)) & set(hashes(None))  # placeholder ids as a token prompt
    assert hashes(rows)[0] != hashes(rows.to(torch.bfloat16))[0]


def test_output_tokens_past_the_rows_extend_the_chain():
    rows = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    req = request(rows, 6)
    req.append_output_token_ids([3, 4, 5])
    assert len(update_block_hashes(req, BLOCK)) == 2  # block 1: two rows, three ids


def test_rows_cross_both_wire_formats():
    rows = torch.randn(5, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    req = request(rows, 5)
    back = request_from_wire(request_to_wire(req))
    assert torch.equal(from_tensor_data(back.prompt_embeds), rows)
    new = NewRequestData(
        "r", [0] * 5, 5, SamplingParams(), [0, 1], 0, prompt_embeds=req.prompt_embeds
    )
    step = SchedulerOutput([new], CachedRequestData(), {"r": 5}, 5)
    decoded = decode(encode(step), SchedulerOutput)
    assert torch.equal(from_tensor_data(decoded.scheduled_new_reqs[0].prompt_embeds), rows)
