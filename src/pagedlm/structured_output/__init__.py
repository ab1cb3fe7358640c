"""Structured outputs: constrain sampling to a JSON schema, regex, choice or EBNF grammar.

``params`` canonicalizes and validates :class:`~pagedlm.StructuredOutputsParams`;
``backend`` is the grammar-backend interface with ``xgrammar_backend`` (default) and
``outlines_backend`` behind it; ``compiler`` compiles off the engine loop with a cache;
``manager`` is the scheduler's component (matchers, the per-step bitmask); ``bitmask``
applies a batch's bitmask to logits in the sampler. Nothing here imports xgrammar or
outlines until a backend is built.
"""
