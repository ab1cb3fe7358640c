"""Model building blocks; each layer's forward is the one place a platform swaps in a kernel."""
