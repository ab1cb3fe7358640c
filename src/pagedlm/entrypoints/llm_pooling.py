"""``LLM``'s pooling API, vLLM's: ``encode``, ``embed``, ``classify``, ``reward`` and
``score``, one pooled output per prompt or text pair, for a model run with
``runner="pooling"`` (``pagedlm.pooling``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pagedlm.engine.exceptions import RequestFailedError
from pagedlm.engine.input_processor import PromptType
from pagedlm.entrypoints.llm_args import UseTqdm, one_per_prompt, prompt_list
from pagedlm.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedlm.pooling.requests import PairPrompt

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.outputs import RequestOutput


def _finish_pooled(
    outputs: list[Any], params_list: Sequence[PoolingParams], pooler: Any
) -> list[Any]:
    """The pooled outputs (in place) with their parameters' finish (normalization,
    ``dimensions``, a classifier's activation); a failed request's output, which pooled
    nothing, as it is."""
    for output, params in zip(outputs, params_list):
        if isinstance(output, PoolingRequestOutput):
            output.outputs.data = params.finish(output.outputs.data, pooler)
    return outputs


@contextlib.contextmanager
def _failure_outputs_as(convert: Callable[[Any], Any]) -> Iterator[None]:
    """A ``RequestFailedError`` of a pooling call with its pooled outputs as ``convert``
    makes them (what the call returns; the failed request's output stays as it is)."""
    try:
        yield
    except RequestFailedError as failure:
        if failure.outputs is not None:
            failure.outputs = [
                convert(out) if isinstance(out, PoolingRequestOutput) else out
                for out in failure.outputs
            ]
        raise


def _pair_score(output: PoolingRequestOutput) -> ScoringRequestOutput:
    """A cross-encoder's pair output as ``LLM.score`` returns it."""
    return ScoringRequestOutput(
        output.request_id,
        ScoringOutput(float(output.outputs.data[0])),
        output.prompt_token_ids,
        output.finished,
    )


class PoolingMethods:
    """Mixed into ``LLM``: its engine (``llm_engine``), request ids (``_request_counter``)
    and engine loop (``_run_engine``) run the pooling requests."""

    llm_engine: LLMEngine
    _request_counter: Iterator[int]

    if TYPE_CHECKING:

        def _run_engine(
            self, request_ids: list[str], use_tqdm: UseTqdm
        ) -> list[RequestOutput | PoolingRequestOutput]: ...

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """One pooled output per prompt (``outputs.data``, float32), in input order; needs
        a pooling model (``runner="pooling"``, or "auto" on an embedding checkpoint). A
        classifier's vector is its labels' probabilities (``LLM.classify``).
        ``truncate_prompt_tokens``: every prompt's ``PoolingParams.truncate_prompt_tokens``
        (vLLM's keyword). ``pooling_task`` (vLLM's): "embed", "classify", "score",
        "token_embed" or "token_classify", checked against the model (the error names the
        tasks it serves); None: the parameters' ``task``, else the model's own. The
        token-wise tasks give a row per prompt token, ``[num_prompt_tokens, hidden or
        num_labels]`` (STEP pooling: a row per step tag; ``pagedlm.pooling.tasks``).
        ``tokenization_kwargs``: as in ``generate``."""
        if pooling_task is not None:
            self._check_task(pooling_task)
        prompts = prompt_list(prompts)
        return self._pool(
            prompts,
            pooling_params,
            use_tqdm,
            truncate_prompt_tokens,
            pooling_task,
            tokenization_kwargs,
        )

    def _pool(
        self,
        prompts: Sequence[PromptType | PairPrompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: UseTqdm,
        truncate_prompt_tokens: int | None = None,
        task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """``encode`` for prompts and text pairs (a cross-encoder's)."""
        from pagedlm.pooling.requests import process_pooling_request

        params_list = one_per_prompt(pooling_params or PoolingParams(), len(prompts), PoolingParams)
        if task is not None:
            params_list = [params.with_task(task) for params in params_list]
        if truncate_prompt_tokens is not None:
            params_list = [
                dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
                for params in params_list
            ]
        engine = self.llm_engine
        processed = [
            process_pooling_request(
                engine.input_processor,
                str(next(self._request_counter)),
                prompt,
                params,
                tokenization_kwargs,
            )
            for prompt, params in zip(prompts, params_list)
        ]
        for request in processed:
            engine.add_processed_request(request)
        pooler = engine.config.model.pooler
        assert pooler is not None
        try:
            outputs = self._run_engine([r.request_id for r in processed], use_tqdm)
        except RequestFailedError as failure:  # the others' outputs as the call gives them
            _finish_pooled(failure.outputs or [], params_list, pooler)
            raise
        assert all(isinstance(output, PoolingRequestOutput) for output in outputs)
        return _finish_pooled(outputs, params_list, pooler)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats), in input
        order; ``encode`` with vLLM's embedding output type."""
        self._check_task("embed")
        with _failure_outputs_as(EmbeddingRequestOutput.from_base):
            outputs = self.encode(
                prompts,
                pooling_params,
                use_tqdm=use_tqdm,
                truncate_prompt_tokens=truncate_prompt_tokens,
                pooling_task="embed",
                tokenization_kwargs=tokenization_kwargs,
            )
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """One probability per label for each prompt (``outputs.probs``), in input order;
        needs a classification model (``*ForSequenceClassification``).
        ``PoolingParams(use_activation=False)`` gives the raw logits."""
        self._check_task("classify")
        with _failure_outputs_as(ClassificationRequestOutput.from_base):
            outputs = self.encode(
                prompts,
                pooling_params,
                use_tqdm=use_tqdm,
                truncate_prompt_tokens=truncate_prompt_tokens,
                pooling_task="classify",
                tokenization_kwargs=tokenization_kwargs,
            )
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Rewards per prompt token (vLLM's): ``encode`` with ``pooling_task=
        "token_classify"``, so ``outputs.data`` is ``[num_prompt_tokens, num_labels]``,
        the head's logits through the model's activation (``PoolingParams(
        use_activation=False)``: raw), or with STEP pooling (process reward models) a row
        per step tag; needs a model that serves token_classify (a reward model, a token or
        sequence classifier)."""
        return self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            truncate_prompt_tokens=truncate_prompt_tokens,
            pooling_task="token_classify",
            tokenization_kwargs=tokenization_kwargs,
        )

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (``outputs.score``), in order: one ``data_1`` text against
        every ``data_2`` text, or the two element-wise. A cross-encoder (a classifier with
        one label) reads each pair as one prompt; an embedding model scores the cosine
        similarity of the two texts' embeddings (``pagedlm.pooling.scoring``)."""
        from pagedlm.pooling import scoring

        pooler = self.llm_engine.config.model.pooler
        self._check_task("score")
        assert pooler is not None
        pairs = scoring.pair_up(
            scoring.as_list(data_1), scoring.as_list(data_2), ("data_1", "data_2")
        )
        if scoring.is_cross_encoder(pooler):
            if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
                raise ValueError(
                    "A cross-encoder joins each pair's texts with its tokenizer; pass strings "
                    "in data_1 and data_2."
                )
            with _failure_outputs_as(_pair_score):
                outputs = self._pool(
                    pairs,
                    pooling_params,
                    use_tqdm,
                    truncate_prompt_tokens,
                    "score",
                    tokenization_kwargs=tokenization_kwargs,
                )
            return [_pair_score(output) for output in outputs]
        firsts = scoring.as_list(data_1)
        vectors = self._pool(
            firsts + [b for _, b in pairs],
            pooling_params,
            use_tqdm,
            truncate_prompt_tokens,
            "score",
            tokenization_kwargs=tokenization_kwargs,
        )
        first_out = vectors[: len(firsts)] * (len(pairs) if len(firsts) == 1 else 1)
        return [
            ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                ScoringOutput(scoring.cosine(a.outputs.data, b.outputs.data)),
                a.prompt_token_ids + b.prompt_token_ids,
            )
            for a, b in zip(first_out, vectors[len(firsts) :], strict=True)
        ]

    def _check_task(self, task: str) -> None:
        from pagedlm.pooling.tasks import check_task

        check_task(self.llm_engine.config.model.pooler, task)
