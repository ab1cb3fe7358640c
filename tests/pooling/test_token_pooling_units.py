"""Token-wise pooling without a model: the tasks a model serves, ``PoolingParams`` on rows,
``--pooler-config``'s token-wise keys, the worker's chunk-by-chunk rows (preemption, STEP
positions), the scheduler's prefix-cache skip, and the wire formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedlm.config import CacheConfig, PoolerConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.engine import messages
from pagedlm.pooling import PoolingParams
from pagedlm.pooling.model_config import with_pooler_overrides
from pagedlm.pooling.outputs import as_tensor_data, pooled_tensor
from pagedlm.pooling.requests import pooling_sampling_params
from pagedlm.pooling.tasks import check_task, supported_tasks
from pagedlm.pooling.token_rows import TokenPooler
from pagedlm.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PoolingSpec,
    SchedulerOutput,
    codec,
)

EMBEDDER = PoolerConfig("LAST", True)
CLASSIFIER = PoolerConfig("LAST", False, labels=("a", "b", "c"), activation="softmax")
TOKEN_CLASSIFIER = PoolerConfig(
    "LAST", False, labels=("a", "b"), activation="softmax", sequence_pooling=False
)


def test_each_kind_of_model_serves_its_tasks_its_own_first():
    assert supported_tasks(EMBEDDER) == ("embed", "token_embed", "score")
    assert supported_tasks(CLASSIFIER) == ("classify", "token_classify")
    cross_encoder = PoolerConfig("CLS", False, labels=("s",), activation="sigmoid")
    assert supported_tasks(cross_encoder) == ("classify", "token_classify", "score")
    assert supported_tasks(TOKEN_CLASSIFIER) == ("token_classify",)
    with pytest.raises(ValueError, match=r"serves the tasks \['token_classify'\].*LLM.reward"):
        check_task(TOKEN_CLASSIFIER, "classify")
    with pytest.raises(ValueError, match=r"does not classify.*\['embed', 'token_embed', 'score'\]"):
        check_task(EMBEDDER, "token_classify")
    with pytest.raises(ValueError, match="needs a pooling model"):
        check_task(None, "token_embed")


def test_pooling_params_treat_every_row_as_a_vector():
    rows = torch.tensor([[3.0, 4.0, 12.0], [0.0, 5.0, 0.0]])
    params = PoolingParams(task="token_embed")
    torch.testing.assert_close(params.finish(rows, EMBEDDER), F.normalize(rows, dim=-1))
    matryoshka = PoolerConfig("LAST", True, True)
    cut = PoolingParams(dimensions=2, task="token_embed").finish(rows.tolist(), matryoshka)
    torch.testing.assert_close(cut, F.normalize(rows[:, :2], dim=-1))
    logits = PoolingParams(task="token_classify")
    torch.testing.assert_close(logits.finish(rows, CLASSIFIER), rows.softmax(-1))
    raw = PoolingParams(use_activation=False, task="token_classify")
    torch.testing.assert_close(raw.finish(rows, CLASSIFIER), rows)
    # "score" on an embedding model is its embedding (scored by cosine similarity).
    PoolingParams(task="score").validate(EMBEDDER, 3)
    torch.testing.assert_close(
        PoolingParams(task="score").finish(rows[0], EMBEDDER), F.normalize(rows[0], dim=-1)
    )
    # No task: the model's own (a vector).
    assert PoolingParams().resolved_task(TOKEN_CLASSIFIER) == "token_classify"
    assert PoolingParams().with_task("embed").task == "embed"
    with pytest.raises(ValueError, match="cannot overwrite"):
        PoolingParams(task="embed").with_task("token_embed")


def test_step_fields_need_step_pooling():
    step = PoolerConfig(
        "LAST", False, labels=("a", "b"), activation="softmax", sequence_pooling=False,
        tok_pooling_type="STEP", step_tag_id=7, returned_token_ids=(1,),
    )  # fmt: skip
    rows = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    # The config's columns, then a sigmoid over the one left (vLLM's rule).
    torch.testing.assert_close(PoolingParams().finish(rows, step), rows[:, [1]].sigmoid())
    both = PoolingParams(returned_token_ids=[1, 0])
    torch.testing.assert_close(both.finish(rows, step), rows[:, [1, 0]].softmax(-1))
    assert PoolingParams().step_tag(step) == 7 and PoolingParams(step_tag_id=3).step_tag(step) == 3
    assert PoolingParams(step_tag_id=3).step_tag(TOKEN_CLASSIFIER) is None
    PoolingParams(step_tag_id=3).validate(step, 8)
    with pytest.raises(ValueError, match=r"tok_pooling_type': 'STEP'"):
        PoolingParams(step_tag_id=3).validate(TOKEN_CLASSIFIER, 8)
    with pytest.raises(ValueError, match="apply to STEP pooling"):
        PoolingParams(returned_token_ids=[0], task="classify").validate(CLASSIFIER, 8)
    with pytest.raises(ValueError, match=r"column indices in \[0, 2\)"):
        PoolingParams(returned_token_ids=[2]).validate(step, 8)
    # An embedding model's STEP pooling keeps the columns too (vLLM's StepPool), before
    # normalizing.
    from pagedlm.pooling.model_config import with_pooler_overrides

    wide = {"tok_pooling_type": "STEP", "step_tag_id": 7, "returned_token_ids": [0, 3]}
    with pytest.raises(ValueError, match=r"\[0, 3\] name columns the embeddings have not"):
        with_pooler_overrides(EMBEDDER, wide, hidden_size=3)
    assert with_pooler_overrides(EMBEDDER, wide, hidden_size=4).returned_token_ids == (0, 3)
    step_embedder = PoolerConfig("LAST", True, tok_pooling_type="STEP", step_tag_id=7)
    kept = PoolingParams(task="token_embed", returned_token_ids=[0, 2])
    kept.validate(step_embedder, 3)
    torch.testing.assert_close(
        kept.finish(rows.repeat(1, 2)[:, :3], step_embedder),
        F.normalize(rows.repeat(1, 2)[:, [0, 2]], dim=-1),
    )


def test_pooler_config_sets_token_wise_pooling_as_vllm_reads_it():
    step = with_pooler_overrides(
        TOKEN_CLASSIFIER, {"pooling_type": "step", "step_tag_id": 9, "returned_token_ids": [1]}
    )
    assert (step.tok_pooling_type, step.step_tag_id, step.returned_token_ids) == ("STEP", 9, (1,))
    assert step.pooling_type == "LAST"  # a token-wise pooling type leaves the sequence one
    both = with_pooler_overrides(EMBEDDER, {"seq_pooling_type": "MEAN", "tok_pooling_type": "ALL"})
    assert (both.pooling_type, both.tok_pooling_type) == ("MEAN", "ALL")
    with pytest.raises(ValueError, match="pooling_type and tok_pooling_type different values"):
        with_pooler_overrides(EMBEDDER, {"pooling_type": "STEP", "tok_pooling_type": "ALL"})
    with pytest.raises(ValueError, match="tok_pooling_type='LAST' is not served"):
        with_pooler_overrides(EMBEDDER, {"tok_pooling_type": "LAST"})
    with pytest.raises(ValueError, match='add "tok_pooling_type": "STEP"'):
        with_pooler_overrides(TOKEN_CLASSIFIER, {"returned_token_ids": [0]})
    with pytest.raises(ValueError, match="it gives 2 labels"):
        with_pooler_overrides(TOKEN_CLASSIFIER, {"pooling_type": "STEP", "returned_token_ids": [5]})


# ------------------------------------------------------------------ the worker's rows


def _new(req_id: str, prompt: list[int], spec: PoolingSpec | None) -> NewRequestData:
    return NewRequestData(
        req_id, prompt, len(prompt), pooling_sampling_params(), [0], 0, pooling=spec
    )


def _step(new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(list(cached)),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def _chunk(pooler, hidden, req_ids, lengths, ends, finishing):
    """Gather and keep one step: requests of ``lengths`` rows whose positions end at
    ``ends``."""
    query_start_loc = np.concatenate([[0], np.cumsum(lengths)])
    chunks = pooler.gather(hidden, req_ids, query_start_loc, np.asarray(ends))
    return pooler.keep(chunks, chunks.values, finishing)


def test_token_rows_gather_chunk_by_chunk_and_start_afresh_after_preemption():
    pooler = TokenPooler(lambda rows: rows[:, :2] * 10, "embed")
    hidden = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    pooler.update(_step(new=[_new("t", list(range(7)), PoolingSpec("token_classify"))]))
    pooler.update(_step(new=[_new("e", [1, 2], PoolingSpec("embed"))]))
    assert "t" in pooler and "e" not in pooler
    # Step 1: 4 rows of "t" then "e"'s 2 (a sequence request: not gathered here).
    assert _chunk(pooler, hidden[:6], ["t", "e"], [4, 2], [4, 2], []) == {}
    # Preempted, then resumed as a new request: its first rows are dropped.
    pooler.update(_step(preempted=["t"]))
    pooler.update(_step(new=[_new("t", list(range(7)), PoolingSpec("token_classify"))]))
    assert _chunk(pooler, hidden[:4], ["t"], [4], [4], []) == {}
    done = _chunk(pooler, hidden[4:7], ["t"], [3], [7], ["t"])
    torch.testing.assert_close(torch.cat(done["t"]), hidden[:7, :2] * 10)
    assert len(pooler) == 0
    # A chunk that does not continue the rows gathered is a bug, not a silent gap.
    pooler.update(_step(new=[_new("g", [1, 2, 3], PoolingSpec("token_classify"))]))
    with pytest.raises(RuntimeError, match="starts at position 1"):
        _chunk(pooler, hidden[:2], ["g"], [2], [3], [])


def test_step_pooling_keeps_the_tagged_positions_of_each_chunk():
    pooler = TokenPooler(None, "token_classify")
    prompt = [5, 9, 6, 9, 9, 7]
    pooler.update(_step(new=[_new("p", prompt, PoolingSpec("token_embed", step_tag_id=9))]))
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert _chunk(pooler, hidden[:3], ["p"], [3], [3], []) == {}
    done = _chunk(pooler, hidden[3:], ["p"], [3], [6], ["p"])
    torch.testing.assert_close(torch.cat(done["p"]), hidden[[1, 3, 4]])
    # A request without a spec runs the model's own task.
    pooler.update(_step(new=[_new("d", [1], None)]))
    assert "d" in pooler
    pooler.update(_step(finished=["d"]))
    assert "d" not in pooler


def test_a_token_wise_request_reads_nothing_from_the_prefix_cache():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = OneBudgetScheduler(
        config, CacheConfig(block_size=4, enable_prefix_caching=True), 64
    )
    prompt = list(range(1, 18))

    def run(req_id: str, task: str) -> int:
        request = Request(req_id, prompt, pooling_sampling_params(), pooling=PoolingSpec(task))
        scheduler.add_request(request)
        step = scheduler.schedule()
        scheduled = step.num_scheduled_tokens[req_id]
        assert step.scheduled_new_reqs[0].pooling == PoolingSpec(task)
        pooled = (
            {req_id: as_tensor_data(torch.zeros(len(prompt), 2))}
            if "token" in task
            else {req_id: [0.5]}
        )
        runner = ModelRunnerOutput([req_id], [[]], pooler_output=pooled)
        [output] = scheduler.update_from_output(step, runner)
        assert output.finish_reason == "stop" and output.pooled is pooled[req_id]
        return scheduled

    assert run("a", "embed") == 17
    assert run("b", "embed") == 1  # 16 tokens from the cache
    assert run("c", "token_embed") == 17  # every position computed


def test_the_wire_carries_the_spec_and_the_rows():
    rows = torch.randn(3, 2)
    output = ModelRunnerOutput(
        ["a", "b"], [[], []], pooler_output={"a": [0.25], "b": as_tensor_data(rows)}
    )
    decoded = codec.decode(codec.encode(output), ModelRunnerOutput)
    assert decoded == output
    torch.testing.assert_close(pooled_tensor(decoded.pooler_output["b"]), rows)
    assert pooled_tensor(decoded.pooler_output["a"]).tolist() == [0.25]
    new = _new("a", [1, 2], PoolingSpec("token_classify", step_tag_id=2))
    step = SchedulerOutput([new], CachedRequestData(), {"a": 2}, 2)
    assert codec.decode(codec.encode(step), SchedulerOutput) == step
    spec = PoolingSpec("token_embed")
    request = Request("r", [1, 2], pooling_sampling_params(), pooling=spec)
    wire = messages.request_to_wire(request)
    assert messages.request_from_wire(wire).pooling == spec
