"""LoRA adapters: many fine-tunes of one base model served in the same steps.

Kept import-free so the step protocol may import ``pagedlm.lora.request`` (a leaf):

- ``request.py``: ``LoRARequest`` (vLLM's fields), what a request names its adapter by.
- ``peft_format.py``: reading and checking a PEFT adapter directory against the model's
  shapes (front end: before a request enters the engine; worker: loading its tensors).
- ``targets.py``: which linear layers of a model take adapters, and their output slices.
- ``layers.py``: ``LoRALinear``, the wrapper kernel over a linear layer (base + delta).
- ``ops.py`` / ``pagedlm_cuda.kernels.lora``: the batched delta (torch on CPU, Triton).
- ``manager.py``: the worker's device slots (``max_loras``) with LRU eviction to a host
  cache (``max_cpu_loras``), and each step's per-token slot indices.
- ``scheduler_gate.py``: the scheduler's limit of distinct adapters per step.
- ``admission.py``: the engine core has the workers read an adapter before the first
  request that names it enters the scheduler.
"""
