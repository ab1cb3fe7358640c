"""What sampling reads from the input batch: the metadata reused across steps only when a
rebuild would give the same, and token histories gathered from the device table."""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.input_batch import InputBatch, RequestState
from pagedlm.worker.sampling_inputs import DeviceTokenHistory, SamplingMetadataCache


def state(req_id: str, slot: int = 0, num_prompt: int = 2, **params) -> RequestState:
    return RequestState(req_id, slot, num_prompt, SamplingParams(**params), None, 1)


def test_metadata_is_reused_only_while_nothing_changes_per_step() -> None:
    cache = SamplingMetadataCache()
    builds = []

    def build():
        builds.append(object())
        return builds[-1]

    plain = [state("a"), state("b")]
    lens = np.array([5, 7])
    first = cache.get(plain, lens, build)
    assert cache.get(plain, lens + 1, build) is first  # the same requests: reused
    assert cache.get(plain[:1], lens[:1], build) is not first  # one left the batch
    again = [state("a"), state("b")]  # same ids, new requests: never confused
    assert cache.get(again, lens, build) is not builds[-2]
    pending = [state("c", min_tokens=4)]  # 5 - 2 = 3 outputs < min_tokens
    one = cache.get(pending, np.array([5]), build)
    assert cache.get(pending, np.array([5]), build) is not one
    done = cache.get(pending, np.array([6]), build)  # 4 outputs: static from now on
    assert cache.get(pending, np.array([7]), build) is done
    penalized = [state("d", repetition_penalty=1.2)]
    one = cache.get(penalized, np.array([5]), build)
    assert cache.get(penalized, np.array([5]), build) is not one


def test_token_history_is_gathered_from_the_table() -> None:
    batch = InputBatch(2, 8, 4, torch.device("cpu"))
    batch.token_ids[0, :6] = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    batch.token_ids[1, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    states = [state("a", slot=0, num_prompt=2), state("b", slot=1, num_prompt=3)]
    history = DeviceTokenHistory(batch, states, np.array([5, 3]))
    prompts, outputs = history([0, 1], pad_id=99)
    assert prompts.tolist() == [[1, 2, 99], [7, 8, 9]]
    assert outputs.tolist() == [[3, 4, 5], [99, 99, 99]]
    prompts, outputs = history([1], pad_id=99)
    assert prompts.tolist() == [[7, 8, 9]] and outputs.shape == (1, 0)
