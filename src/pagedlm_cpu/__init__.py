"""pagedlm's CPU platform: runs everywhere torch runs; the reference for other backends."""
