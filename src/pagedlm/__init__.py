"""pagedlm: high-throughput, memory-efficient LLM inference in pure Python.

Importing this package loads only the core dependencies (torch, transformers, pluggy);
the server, gguf and grammar libraries are imported when a feature needs them.
"""

from pagedlm.inputs import PromptType, TextPrompt, TokensPrompt
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
    "hookimpl",
]


_POOLING_NAMES = frozenset(
    {
        "ClassificationOutput",
        "ClassificationRequestOutput",
        "EmbeddingOutput",
        "EmbeddingRequestOutput",
        "PoolingOutput",
        "PoolingParams",
        "PoolingRequestOutput",
        "ScoringOutput",
        "ScoringRequestOutput",
    }
)


def __getattr__(name: str):
    # LLM pulls in the engine; import it on first use so `import pagedlm` stays light.
    if name == "LLM":
        from pagedlm.entrypoints.llm import LLM

        return LLM
    if name in _POOLING_NAMES:
        import pagedlm.pooling  # torch, which `import pagedlm` alone does not load

        return getattr(pagedlm.pooling, name)
    if name == "BeamSearchParams":
        from pagedlm.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("AsyncLLM", "AsyncLLMEngine"):  # vLLM's V1 names its AsyncLLM both ways
        from pagedlm.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("EngineArgs", "AsyncEngineArgs"):  # one set of arguments for both engines
        from pagedlm.engine.arg_utils import EngineArgs

        return EngineArgs
    if name == "LLMEngine":
        from pagedlm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedlm' has no attribute {name!r}")
