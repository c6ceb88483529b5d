"""End-to-end checks of the vLLM engine features a GPU user relies on (issue 8)."""
