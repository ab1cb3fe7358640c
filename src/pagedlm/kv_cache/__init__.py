"""The paged KV cache: device storage (``KVCache``) and its bookkeeping (block pool, manager)."""
