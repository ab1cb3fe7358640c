"""Multimodal input (images): from the user's prompt to embeddings inside the step.

- ``tensors``: torch tensors <-> the step protocol's ``TensorData`` (bytes + shape + dtype).
- ``processing``: the front end's side: the model's own transformers processor expands
  each image's placeholder and yields the prompt's ``MultiModalFeature`` list, each named
  by a content hash (``hash_item``).
- ``processor_kwargs``: ``mm_processor_kwargs`` checked against the options the model's
  image processor declares; ``item_geometry``: each processed image checked against what
  the model's encoder takes.
- ``media``: images from the API's content parts (data URLs, http(s) with a size cap and
  timeout from ``--allowed-media-domains`` hosts, local files under
  ``--allowed-local-media-path``), with PIL's pixel limit.
- ``encoder_runner``: the worker's side: encode the step's scheduled images into the
  encoder cache, then scatter their rows over the placeholder positions of the step's
  token embeddings.
- ``mrope``: M-RoPE models' three-part positions (Qwen2.5-VL), per request, computed when
  the workers admit it, and each step's positions built from them.
- ``qwen_vl_processor``: Qwen2.5-VL's transformers processor for images only.

The scheduler's side (which images a step encodes, under the encoder budget) is
``pagedlm.core.encoder_budget``.
"""
