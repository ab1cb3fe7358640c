"""gpt-oss on the Triton backend against transformers' logits: the attention sinks and the
alternating windowed and full layers through the prefill, verification and decode
kernels. Under the Triton interpreter on CPU (a few prompts, ~10 s) and on the GPU.

The checkpoint is ``tests/model_executor/test_zoo_models_gpt_oss.py``'s (8-token window).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error

from model_executor.test_zoo_models_gpt_oss import save_gpt_oss
from model_utils import PagedRunner
from pagedlm.model_executor.loader import load_model
from pagedlm_cuda.attention import TritonAttentionBackend
from tiny_checkpoints import hf_logits, model_config, random_prompts

PROMPT_LENS = [1, 6, 23, 12]
"""A single token, a verification-sized chunk (<= 8), and prompts past the window."""
TOLERANCE = 1e-2 if ON_GPU else 1e-4  # float32 on the GPU runs the dots in tf32


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt_oss_triton")
    hf_model = save_gpt_oss(path)
    prompts = random_prompts(PROMPT_LENS)
    expected = [hf_logits(hf_model, p) for p in prompts]
    return load_model(model_config(path, 128), DEVICE), prompts, expected


def runner(model: torch.nn.Module) -> PagedRunner:
    backend = TritonAttentionBackend(DEVICE)
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), 4, backend, DEVICE)


def test_prefill_matches_transformers(case) -> None:
    model, prompts, expected = case
    got = runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    assert rel_error(torch.cat(got), torch.cat(expected)) < TOLERANCE


def test_chunk_then_decodes_match_transformers(case) -> None:
    """A first chunk of each prompt (the 6-token one's through the verification kernel,
    in a step of its own), then 3 decode steps."""
    model, prompts, expected = case
    paged = runner(model)
    short = [i for i, p in enumerate(prompts) if len(p) <= 8]
    long = [i for i, p in enumerate(prompts) if len(p) > 8]
    got = dict(zip(short, paged.step([(i, 0, prompts[i]) for i in short]), strict=True))
    split = {i: len(prompts[i]) - 3 for i in long}
    first = paged.step([(i, 0, prompts[i][: split[i]]) for i in long])
    got.update(zip(long, first, strict=True))
    for offset in range(3):
        steps = [(i, split[i] + offset, [prompts[i][split[i] + offset]]) for i in long]
        for (i, _, _), logits in zip(steps, paged.step(steps), strict=True):
            got[i] = torch.cat([got[i], logits])
    ordered = [got[i] for i in range(len(prompts))]
    assert rel_error(torch.cat(ordered), torch.cat(expected)) < TOLERANCE
