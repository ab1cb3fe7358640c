"""The step protocol: what crosses the scheduler/worker boundary once per step.

A leaf package: it imports nothing of pagedlm but ``sampling_params`` and
``lora.request`` (leaves themselves), so
the scheduler, the KV-cache manager, the sampler, structured outputs, workers and
executors may all import it without cycles. Everything in it is plain data (dataclasses
of ints, strings, lists and dicts, a numpy bitmask) that ``codec`` serializes with
msgspec, because workers will live in other processes (tensor/pipeline-parallel ranks,
Ray actors).

One step is two calls on the workers (``Executor.execute_model`` with the
``SchedulerOutput``, then ``Executor.sample_tokens`` with the step's ``GrammarBitmask``),
answered by one ``ModelRunnerOutput``, collected through a ``StepResult`` handle.
"""

from pagedlm.step.kv_transfer import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from pagedlm.step.multimodal import MultiModalFeature, TensorData
from pagedlm.step.pooling import PoolingSpec
from pagedlm.step.runner_output import (
    FinishedStep,
    LogprobsLists,
    ModelRunnerOutput,
    StepResult,
)
from pagedlm.step.scheduler_output import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "BlockTransfer",
    "CachedRequestData",
    "FinishedStep",
    "GrammarBitmask",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "LogprobsLists",
    "ModelRunnerOutput",
    "MultiModalFeature",
    "NewRequestData",
    "PoolingSpec",
    "SchedulerOutput",
    "StepResult",
    "TensorData",
]
