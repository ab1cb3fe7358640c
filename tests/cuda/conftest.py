"""Triton kernel tests: decide GPU or interpreter before any test module imports Triton."""

import triton_env  # noqa: F401 - sets TRITON_INTERPRET=1 when there is no GPU
