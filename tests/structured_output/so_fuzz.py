"""Random structured-output workloads for the engine-level fuzz test (``test_engine_fuzz.py``).

A case is an engine configuration (asynchronous scheduling, a speculative method, chunked
prefill, prefix caching, a KV cache small enough to preempt, grammars after the model's
thought: a reasoning parser) and a batch of requests, each with an optional grammar (JSON
schema, regex, choice, EBNF) and random sampling fields (greedy or seeded, ``n``, stop
strings, ``min_tokens``, logprobs, an abort after a few steps). ``run_case`` drives an
``LLMEngine`` step by step and returns every request's final completions; ``check_output``
checks one completion against its grammar with Python's own ``re``/``json``/``jsonschema``
and with a fresh matcher of the engine's backend, from the token after its thought.

With a reasoning parser, a prompt may end by opening the thought (``<think>``) or closing it,
and a logit bias on ``</think>`` (and ``<think>``) makes the random model end (and open)
thoughts; the thought's tokens are free, and where the answer starts is computed here from
the prompt and the tokens, independently of the engine (``thought_end``).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jsonschema
import torch

from pagedlm import SamplingParams, StructuredOutputsParams
from pagedlm.core.grammar_gate import GRAMMAR_DEAD_END
from pagedlm.structured_output.params import grammar_spec
from server.server_utils import EOS_ID, THINK_END_ID, THINK_START_ID, write_chat_checkpoint

WORDS = ["cat", "dog", "abc", "red", "blue", "café", "x1", "tab", "zz", "ok", "no", "yes"]
ALPHABET = "abcxyz019"


def write_models(root: Path) -> dict[str, str]:
    """The target (the server tests' tiny byte-level llama, its tokenizer with ``<think>``
    and ``</think>``) and a one-layer draft with the same vocabulary and tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = write_chat_checkpoint(root / "target", thinking=True)
    draft = write_chat_checkpoint(root / "draft", thinking=True)
    config = LlamaConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    torch.manual_seed(3)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(draft)
    return {"target": str(target), "draft": str(draft)}


# ---------------------------------------------------------------------------- grammars


@dataclass(frozen=True)
class Grammar:
    params: StructuredOutputsParams
    kind: str
    value: Any  # the schema, regex, choices or EBNF text


def _short_string(rng: random.Random) -> dict:
    low = rng.randint(0, 2)
    return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 4)}


def _schema_property(rng: random.Random, depth: int = 0) -> dict:
    roll = rng.random()
    if roll < 0.3:
        return {"enum": rng.sample(WORDS, rng.randint(1, 3))}
    if roll < 0.55:
        low = rng.randint(-5, 20)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if roll < 0.75:
        return _short_string(rng)
    if roll < 0.85:
        return {"type": "boolean"}
    if depth == 0 and roll < 0.93:
        return {
            "type": "array",
            "items": {"enum": rng.sample(WORDS, 2)},
            "minItems": 0,
            "maxItems": rng.randint(1, 3),
        }
    if depth == 0:
        return _schema(rng, depth + 1)
    return {"enum": rng.sample(WORDS, 2)}


def _schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["a", "b", "name", "n", "k_1", "é"], rng.randint(1, 3))
    properties = {name: _schema_property(rng, depth) for name in names}
    return {
        "type": "object",
        "properties": properties,
        "required": names,
        "additionalProperties": False,
    }


def _regex_atom(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(["a", "xy", "\\-", " ", "é", ":", "\t", "\\."])
    if roll < 0.6:
        low = rng.randint(0, 2)
        return f"[{rng.choice(['a-c', 'x-z', '0-9', 'a-z0-9'])}]{{{low},{low + rng.randint(1, 4)}}}"
    if roll < 0.8:
        return "(" + "|".join(rng.sample(["ab", "cd", "e", "ok", "no"], 2)) + ")"
    return rng.choice(["[0-9]+", "(ab)?", "x?y"])


INVALID = [
    StructuredOutputsParams(regex="(ab"),
    StructuredOutputsParams(regex="a{5,2}"),
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
    StructuredOutputsParams(grammar='root ::= "a" undefined_rule'),
]


def random_grammar(rng: random.Random, backend: str) -> Grammar:
    kinds = ["json", "regex", "choice"]
    if backend == "xgrammar":
        kinds += ["grammar", "json_object"]
    kind = rng.choice(kinds)
    if kind == "json_object":
        params = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        return Grammar(params, kind, {"type": "object"})
    if kind == "json":
        schema = _schema(rng)
        compact = rng.random() < 0.7
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        return Grammar(params, kind, schema)
    if kind == "regex":
        regex = "".join(_regex_atom(rng) for _ in range(rng.randint(1, 4)))
        if not regex.strip():  # SamplingParams refuses a blank regex
            regex += "[a-c]"
        return Grammar(StructuredOutputsParams(regex=regex), kind, regex)
    if kind == "choice":
        choices = sorted({rng.choice(WORDS) + rng.choice(["", "s", " x"]) for _ in range(3)})
        return Grammar(StructuredOutputsParams(choice=choices), kind, choices)
    words = rng.sample(WORDS, 3)
    ebnf = (
        'root ::= item ("," item){0,3}\n'
        f'item ::= "{words[0]}" | "{words[1]}" [0-9]{{1,2}} | "[" "{words[2]}"? "]"'
    )
    return Grammar(StructuredOutputsParams(grammar=ebnf), kind, ebnf)


def grammar_matches(grammar: Grammar, text: str) -> bool:
    """Whether ``text`` is a complete match, by Python's own checkers (None: no checker)."""
    if grammar.kind in ("json", "json_object"):
        try:
            # strict=False: xgrammar lets length-bounded strings hold raw control
            # characters (its rule, not the engine's), which strict JSON refuses.
            jsonschema.validate(json.loads(text, strict=False), grammar.value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if grammar.kind == "regex":
        return re.fullmatch(grammar.value, text) is not None
    if grammar.kind == "choice":
        return text in grammar.value
    return True  # EBNF: the backend's matcher decides (check_output)


# ---------------------------------------------------------------------------- requests


@dataclass
class RequestCase:
    request_id: str
    prompt: str
    params: SamplingParams
    grammar: Grammar | None
    abort_at_step: int | None = None
    add_at_step: int = 0
    """Added before this step (0: before the first), so requests arrive mid-run."""
    invalid: bool = False
    """Its grammar is invalid: adding it raises ValueError and nothing else changes."""
    replaced_by: RequestCase | None = None
    """Added under the same id right after the abort (its step may still be in flight)."""
    reasoning_ended: bool | None = True
    """Where its output starts against the thought (the engine's ``reasoning_ended``, found
    here from the prompt): True, the answer; False, inside a thought; None, its first token
    decides."""

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0


def _prompt(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
    text = " ".join(words)
    # Repeated text: n-gram lookups find drafts, and prompts share prefix-cache blocks.
    text = text * rng.randint(1, 6) if rng.random() < 0.6 else "shared prefix " * 4 + text
    return text[:64]  # one token per byte: at most 64 prompt tokens


PROMPT_ENDINGS = ["", "<think>", "<think>\n", "<think>\n\n</think>\n\n", "<think>ok</think>"]
"""How a prompt may end for an engine with a reasoning parser: no marker, a thought opened
(Qwen3.5's template), a thought closed (thinking off, a prefill)."""


def prompt_reasoning_ended(reasoning_parser: str | None, prompt: str) -> bool | None:
    """Where the output of ``prompt`` starts: the last marker decides, else the family
    (``deepseek_r1`` inside a thought, ``qwen3`` its first token); True without a parser."""
    if reasoning_parser is None:
        return True
    opened, closed = prompt.rfind("<think>"), prompt.rfind("</think>")
    if opened != closed:
        return closed > opened
    return False if reasoning_parser == "deepseek_r1" else None


def thought_end(reasoning_ended: bool | None, tokens: list[int]) -> int:
    """The index of the first token after the thought (``len(tokens)``: still inside)."""
    state = reasoning_ended
    for index, token in enumerate(tokens):
        if state is True:
            return index
        if state is None:
            if token != THINK_START_ID:
                return index
            state = False
        elif token == THINK_END_ID:
            return index + 1
    return 0 if state is True else len(tokens)


def random_request(
    rng: random.Random, request_id: str, backend: str, reasoning_parser: str | None = None
) -> RequestCase:
    """``reasoning_parser``: the engine's (its grammars apply after the thought)."""
    if rng.random() < 0.05:
        params = SamplingParams(max_tokens=4, structured_outputs=rng.choice(INVALID))
        add_at = rng.randint(0, 6)
        return RequestCase(request_id, "bad", params, None, add_at_step=add_at, invalid=True)
    grammar = random_grammar(rng, backend) if rng.random() < 0.75 else None
    greedy = rng.random() < 0.7
    fields: dict[str, Any] = dict(
        temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
        seed=None if greedy else rng.randint(0, 1000),
        max_tokens=rng.randint(1, 40),
        n=1 if rng.random() < 0.8 else rng.randint(2, 3),
    )
    if rng.random() < 0.2:
        fields["min_tokens"] = rng.randint(0, min(5, fields["max_tokens"]))
    if rng.random() < 0.2:
        fields["stop"] = [rng.choice(['"', "a", "}", ",", "x"])]
    if rng.random() < 0.3:
        fields["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        fields["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.15:
        penalty = rng.choice(["repetition_penalty", "frequency_penalty", "presence_penalty"])
        fields[penalty] = rng.choice([1.3, 0.5]) if penalty == "repetition_penalty" else 0.8
    if rng.random() < 0.1:
        fields["ignore_eos"] = True
    if rng.random() < 0.1:
        fields["stop_token_ids"] = [rng.choice([4, 28, 67, 93])]  # '"', ':', 'a', '{'
    if rng.random() < 0.1 and not greedy:
        name = rng.choice(["top_k", "top_p", "min_p"])
        fields[name] = 2 if name == "top_k" else rng.choice([0.5, 0.1])
    add_at = 0 if rng.random() < 0.7 else rng.randint(1, 10)
    abort_at = add_at + rng.randint(0, 12) if rng.random() < 0.15 else None
    replaced_by = None
    if abort_at is not None and rng.random() < 0.5:
        replaced_by = random_request(rng, request_id, backend, reasoning_parser)
        replaced_by = replace(replaced_by, add_at_step=abort_at, abort_at_step=None)
        if replaced_by.invalid:
            replaced_by = None
    prompt = _prompt(rng)
    if reasoning_parser is not None:
        # A separate stream: the cases without a parser stay what they were.
        thinking = random.Random(f"{request_id}-{prompt}")
        prompt += thinking.choice(PROMPT_ENDINGS)
        bias = {THINK_END_ID: thinking.choice([4.0, 6.0, 9.0])}
        if thinking.random() < 0.5:
            bias[THINK_START_ID] = thinking.choice([3.0, 8.0])
        if thinking.random() < 0.9:
            fields["logit_bias"] = bias
    return RequestCase(
        request_id,
        prompt,
        SamplingParams(**fields, structured_outputs=grammar and grammar.params),
        grammar,
        abort_at,
        add_at,
        replaced_by=replaced_by,
        reasoning_ended=prompt_reasoning_ended(reasoning_parser, prompt),
    )


def engine_reasoning_parser(config: dict[str, Any]) -> str | None:
    """The reasoning parser after whose thought the engine applies grammars, or None."""
    reasoning = config.get("structured_outputs_config") or {}
    if reasoning.get("enable_in_reasoning"):
        return None
    return reasoning.get("reasoning_parser")


def random_engine_config(rng: random.Random, models: dict[str, str]) -> dict[str, Any]:
    backend = rng.choice(["xgrammar", "xgrammar", "outlines"])
    config: dict[str, Any] = dict(
        structured_outputs_backend=backend,
        async_scheduling=rng.random() < 0.5,
        max_num_batched_tokens=rng.choice([16, 32, 64, 256]),
        enable_prefix_caching=rng.random() < 0.7,
        # 14 blocks of 8 hold one request at its longest (64 + 40 tokens): preemption.
        num_kv_blocks=rng.choice([14, 20, 128]),
        block_size=8,
        max_num_seqs=rng.choice([4, 16]),
    )
    method = rng.choice([None, "ngram", "draft_model", "self_draft"])
    k = rng.randint(1, 4)
    if method == "ngram":
        config["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "min_acceptance_rate": 0,
        }
    elif method is not None:
        draft = models["draft"] if method == "draft_model" else models["target"]
        config["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": k,
            "min_acceptance_rate": 0,
        }
    return config


def plain_variant(config: dict[str, Any]) -> dict[str, Any]:
    """The same engine without speculation, scheduled synchronously."""
    return {**config, "async_scheduling": False, "speculative_config": None}


@dataclass
class Case:
    engine: dict[str, Any]
    requests: list[RequestCase] = field(default_factory=list)


def random_case(seed: int, models: dict[str, str]) -> Case:
    rng = random.Random(seed)
    engine = random_engine_config(rng, models)
    thinking = random.Random(f"reasoning-{seed}")  # apart: the other draws stay as they were
    if thinking.random() < 0.4:
        engine["structured_outputs_config"] = {
            "reasoning_parser": thinking.choice(["qwen3", "deepseek_r1"]),
            "enable_in_reasoning": thinking.random() < 0.15,
        }
    backend = engine["structured_outputs_backend"]
    parser = engine_reasoning_parser(engine)
    requests = [
        random_request(rng, f"r{seed}-{i}", backend, parser) for i in range(rng.randint(1, 7))
    ]
    return Case(engine, requests)


# ---------------------------------------------------------------------------- running


class Engines:
    """One ``LLMEngine`` per engine configuration, built on first use; the least recently
    used beyond ``MAX_ENGINES`` are shut down."""

    MAX_ENGINES = 6

    def __init__(self, model: str) -> None:
        self.model = model
        self._engines: dict[str, Any] = {}

    def get(self, config: dict[str, Any]):
        from pagedlm.engine.arg_utils import EngineArgs
        from pagedlm.engine.llm_engine import LLMEngine

        key = json.dumps(config, sort_keys=True)
        engine = self._engines.pop(key, None)
        if engine is None:
            args = EngineArgs(model=self.model, max_model_len=256, dtype="float32", **config)
            engine = LLMEngine.from_engine_args(args)
        self._engines[key] = engine  # the most recently used last
        while len(self._engines) > self.MAX_ENGINES:
            self._engines.pop(next(iter(self._engines))).shutdown()
        return engine

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()


def scheduler_of(engine):
    return engine.engine_core.scheduler


def run_case(engine, requests: list[RequestCase], max_steps: int = 2000) -> dict[str, Any]:
    """The final ``RequestOutput`` of every request that was not aborted (an abort ends a
    request without an output), and of those that finished before their abort."""
    finals: dict[str, Any] = {}
    pending = sorted(requests, key=lambda c: c.add_at_step)
    last_abort = max((c.abort_at_step or 0 for c in requests), default=0)
    for step in range(max_steps + 1):
        while pending and pending[0].add_at_step <= step:
            _add(engine, pending.pop(0))
        # Ids of requests that already finished too: aborting them is a no-op.
        to_abort = [c.request_id for c in requests if c.abort_at_step == step]
        if to_abort:
            engine.abort_request(to_abort)
            for case in requests:
                if case.request_id in to_abort and case.replaced_by is not None:
                    _add(engine, case.replaced_by)
        if not engine.has_unfinished_requests():
            if not pending and step >= last_abort:
                break
            continue
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
    # Drain a step that may still be in flight, then check the block pool.
    while engine.engine_core.has_unfinished_requests():
        engine.step()
    scheduler = scheduler_of(engine)
    assert not scheduler.requests, f"requests left in the scheduler: {list(scheduler.requests)}"
    manager = scheduler.kv_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    assert not engine.engine_core.structured_output._requests, "matchers leaked"
    return finals


def _add(engine, case: RequestCase) -> None:
    if not case.invalid:
        engine.add_request(case.request_id, case.prompt, case.params)
        return
    try:
        engine.add_request(case.request_id, case.prompt, case.params)
    except ValueError as error:
        assert "structured_outputs" in str(error) or "JSON schema" in str(error), error
    else:
        raise AssertionError(f"an invalid grammar was accepted: {case.params.structured_outputs}")


def check_output(engine, case: RequestCase, output, completion) -> None:
    """``completion`` (of the ``RequestOutput`` ``output``) of ``case`` obeys its grammar
    and its sampling fields."""
    params = case.params
    tokens = completion.token_ids
    reason = completion.finish_reason
    assert reason in ("stop", "length", "abort"), (case, completion)
    assert len(tokens) <= params.max_tokens, (case, completion)
    if reason == "length":
        assert len(tokens) == params.max_tokens or len(tokens) == 0, (case, completion)
    if params.logprobs is not None and tokens:
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
        for token, row in zip(tokens, completion.logprobs, strict=True):
            assert token in row and math.isfinite(row[token].logprob), (case, completion)
    if params.prompt_logprobs is not None:
        rows = output.prompt_logprobs
        assert rows is not None and len(rows) == len(output.prompt_token_ids), (case, output)
        assert rows[0] is None and all(
            token in row for token, row in zip(output.prompt_token_ids[1:], rows[1:])
        ), (case, output)
    if reason == "stop" and isinstance(completion.stop_reason, int):
        assert completion.stop_reason in params.stop_token_ids, (case, completion)
        assert tokens[-1] == completion.stop_reason, (case, completion)
    if case.grammar is None:
        return
    # No request here narrows what it may sample (no allowed_token_ids, bad_words or -inf
    # bias), so a sampled token the grammar refuses means a mask let it through.
    assert (reason, completion.stop_reason) != ("abort", GRAMMAR_DEAD_END), (case, completion)
    # The thought's tokens are free; the grammar governs the answer, from the token after it.
    start = thought_end(case.reasoning_ended, list(tokens))
    answer = tokens[start:]
    backend = engine.engine_core.structured_output.compiler.backend
    matcher = backend.make_matcher(backend.compile(grammar_spec(case.grammar.params)))
    for index, token in enumerate(answer, start=start):
        assert matcher.accept_token(token), (
            f"token {index} ({token}) breaks the grammar",
            case,
            completion,
        )
    # EOS ends a request inside its thought too, where the grammar has not begun.
    ended_by_grammar = reason == "stop" and completion.stop_reason is None and start < len(tokens)
    if ended_by_grammar:
        assert tokens and tokens[-1] == EOS_ID, (case, completion)
        assert matcher.is_terminated(), ("stop before the grammar ended", case, completion)
        text = backend.tokenizer.decode(answer[:-1]) if start else completion.text
        assert grammar_matches(case.grammar, text), (case, completion)
    if reason == "stop" and isinstance(completion.stop_reason, str):
        assert params.stop and completion.stop_reason in params.stop


def summary(output) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason) for c in output.outputs]


def without_abort(requests: list[RequestCase]) -> list[RequestCase]:
    return [replace(c, abort_at_step=None, replaced_by=None) for c in requests]


def final_case(case: RequestCase, finals: dict[str, Any]) -> RequestCase:
    """The request whose output ``finals`` holds under ``case``'s id: its replacement if
    it was aborted and replaced."""
    if case.replaced_by is not None and case.abort_at_step is not None:
        return case.replaced_by
    return case


PIECES = ["a", "b", "c", "x", "y", "z", "0", "1", "9", "-", " ", "é", ":", "\t", "."]
PIECES += ["xy", "ab", "cd", "e", "ok", "no"]


def random_regex(rng: random.Random) -> str:
    regex = "".join(_regex_atom(rng) for _ in range(rng.randint(1, 4)))
    return regex if regex.strip() else regex + "[a-c]"


def candidate_strings(rng: random.Random, regex: str, count: int) -> list[str]:
    """Strings made of the pieces regexes are made of: about half match ``regex``."""
    pieces = [p for p in PIECES if re.search(re.escape(p), regex)] or PIECES
    found: set[str] = set()
    for _ in range(count * 20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        matches = re.fullmatch(regex, text) is not None
        if matches or len(found) < count // 2:
            found.add(text)
        if len(found) >= count:
            break
    return sorted(found)


def full_match_by_matcher(backend, compiled, token_ids: list[int]) -> bool:
    """Whether a fresh matcher takes ``token_ids`` and then its stop token."""
    matcher = backend.make_matcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids) and matcher.accept_token(EOS_ID)
