"""Sleep mode through ``LLM`` on CPU: levels 1 and 2 free the KV cache (level 2 the model
runner), wake_up gives the same greedy tokens, and busy or sleeping engines refuse what
they cannot do; ``wake_up(tags)`` wakes the weights, then the KV cache;
``LLM.reset_prefix_cache``; a speculative proposer's KV cache and weights sleep with the
target's. The benchmark module runs on a tiny
checkpoint."""

from __future__ import annotations

import json

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks import sleep_mode
from pagedlm.step import CachedRequestData, SchedulerOutput

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [{"prompt_token_ids": list(range(5, 40))}]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(
        str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=32,
        enable_sleep_mode=True,
        disable_log_stats=False,
    )  # fmt: skip


def tokens(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_restores(llm, level):
    worker = llm.llm_engine.engine_core.executor.worker
    expected = tokens(llm)
    llm.sleep(level)  # vLLM's LLM.sleep / LLM.wake_up
    assert worker.sleep_level == level and llm.llm_engine.is_sleeping()
    state = {m.labels["sleep_state"]: m.value for m in llm.get_metrics() if "sleep" in m.name}
    assert state == {"awake": 0, "weights_offloaded": level == 1, "discard_all": level == 2}
    if level == 1:
        assert worker.model_runner.kv_cache is None
    else:
        assert worker.model_runner is None
    with pytest.raises(ValueError, match=r"asleep; call wake_up\(\)"):
        llm.generate(PROMPT, PARAMS, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the refusal left nothing behind
    llm.wake_up()
    assert worker.sleep_level == 0 and worker.model_runner.kv_cache is not None
    assert [m.value for m in llm.get_metrics() if m.labels.get("sleep_state") == "awake"] == [1]
    assert tokens(llm) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_wake_up_by_tags_weights_then_kv_cache(llm, level):
    engine = llm.llm_engine
    worker = engine.engine_core.executor.worker
    expected = tokens(llm)
    llm.sleep(level)
    with pytest.raises(ValueError, match=r"wake_up\(tags=\['weights'\]\) before"):
        llm.wake_up(tags=["kv_cache"])
    with pytest.raises(ValueError, match=r"\['optimizer'\] are not supported"):
        llm.wake_up(tags=["weights", "optimizer"])
    assert worker.sleeping_tags == {"weights", "kv_cache"}  # the refusals woke nothing
    llm.wake_up(tags=["weights"])
    assert engine.is_sleeping() and worker.sleeping_tags == {"kv_cache"}
    assert worker.model_runner.kv_cache is None
    assert llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))[0] > 0
    with pytest.raises(ValueError, match=r"KV cache is still asleep; call wake_up\(tags="):
        llm.generate(PROMPT, PARAMS, use_tqdm=False)
    assert engine.step() == []  # nothing to run; nothing reaches the worker
    with pytest.raises(RuntimeError, match="KV cache is asleep"):
        worker.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
    llm.wake_up(tags=["weights"])  # already awake: nothing to do
    llm.sleep(level)  # the woken weights sleep again
    assert worker.sleeping_tags == {"weights", "kv_cache"}
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping() and worker.sleep_level == 0
    assert tokens(llm) == expected


def test_busy_engine_refuses_to_sleep(llm):
    engine = llm.llm_engine
    engine.add_request("busy", PROMPT[0], PARAMS)
    with pytest.raises(ValueError, match="unfinished"):
        engine.engine_core.sleep(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.engine_core.sleep_level == 0


def test_bad_level(llm):
    with pytest.raises(ValueError, match="sleep level"):
        llm.llm_engine.engine_core.sleep(3)


def test_benchmark_reports_every_level(tiny_checkpoint, tmp_path):
    out = tmp_path / "sleep.json"
    figures = sleep_mode.main(
        [
            "--model",
            str(tiny_checkpoint("llama")),
            "--max-model-len",
            "256",
            "--output-json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == figures
    assert [level["level"] for level in figures["levels"]] == [1, 2]
    assert all(level["same_tokens_after_wake_up"] for level in figures["levels"])


def test_reset_prefix_cache_forgets_the_cached_prompt(llm):
    def hits() -> int:
        return llm.llm_engine.engine_core.make_stats().prefix_cache_hits

    tokens(llm)
    before = hits()
    tokens(llm)  # the same prompt: its full blocks come from the cache
    cached = hits() - before
    assert cached > 0
    assert llm.reset_prefix_cache()
    before = hits()
    tokens(llm)
    assert hits() - before == 0


def test_sleep_needs_enable_sleep_mode_as_in_vllm(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=8)
    assert not llm.model_config.enable_sleep_mode  # vLLM's default
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep(1)
    assert llm.llm_engine.engine_core.sleep_level == 0
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_sleep_drops_the_proposers_kv_cache_and_offloads_its_weights(tmp_path, method):
    """A speculative proposer's KV cache (and its graphs) sleep with the target's, and its
    weights are offloaded with the target's; the woken engine drafts as before."""
    from spec_decode.tiny_heads import write_eagle, write_llama

    target = write_llama(tmp_path / "target", num_layers=2, seed=0)
    if method == "eagle":
        spec = {"method": "eagle", "model": str(write_eagle(tmp_path / "eagle"))}
    else:
        draft = write_llama(tmp_path / "draft", num_layers=1, seed=3)
        spec = {"method": "draft_model", "model": str(draft)}
    llm = LLM(
        str(target), skip_tokenizer_init=True, num_kv_blocks=32, enable_sleep_mode=True,
        speculative_config={**spec, "num_speculative_tokens": 2},
    )  # fmt: skip
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        proposer = runner.speculator.proposer
        own = proposer.model if method == "draft_model" else proposer.head
        assert any(module is own for module in runner.weight_modules())
        expected = tokens(llm)
        llm.sleep(1)
        assert proposer.kv_cache is None and runner.kv_cache is None
        llm.wake_up()
        assert proposer.kv_cache is not None
        assert tokens(llm) == expected
    finally:
        llm.llm_engine.shutdown()
