"""The ``pagedlm`` command: ``serve``, ``generate``, ``chat`` and ``bench serve``."""
