"""Custom logits processors: user classes that rewrite a step's logits before sampling.

The interface is vLLM v1's (``LogitsProcessor``, ``BatchUpdate``, ``AdapterLogitsProcessor``),
so a processor written for vLLM ports by changing its imports and its constructor's first
parameter (pagedlm's ``EngineConfig``). See ``docs/logits_processors.md``.
"""

from pagedlm.sample.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from pagedlm.sample.logits_processor.batch import BatchRequest, CustomLogitsProcessors
from pagedlm.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
    process_dict_updates,
)
from pagedlm.sample.logits_processor.loading import (
    ENTRY_POINT_GROUP,
    load_logits_processors,
    portable_name,
    qualified_name,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchRequest",
    "BatchUpdate",
    "CustomLogitsProcessors",
    "LogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "load_logits_processors",
    "portable_name",
    "process_dict_updates",
    "qualified_name",
]
