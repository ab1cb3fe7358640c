"""pagedlm: high-throughput, memory-efficient LLM inference in pure Python.

Importing this package loads only the core dependencies (torch, transformers, pluggy);
the server, gguf and grammar libraries are imported when a feature needs them.
"""

from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
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
    if name == "AsyncLLM":
        from pagedlm.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'pagedlm' has no attribute {name!r}")
