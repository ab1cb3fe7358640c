"""model_executor."""
