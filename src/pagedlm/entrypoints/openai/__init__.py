"""The OpenAI- and Anthropic-compatible HTTP server (``pip install pagedlm[server]``).

Modules: ``app`` (routes), ``api_server`` (``pagedlm serve``), ``protocol`` /
``protocol_anthropic`` (request bodies), ``serving_*`` (one per endpoint family),
``errors``, ``middleware`` (API key, body size), ``logprobs_format``.
"""
