"""User-facing entry points: the offline ``LLM`` class (the server and CLI come as extras)."""
