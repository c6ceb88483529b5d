"""vLLM attention backends of the Spyre plugin.

Each backend is published in the core's entry-point group
``spyre_inference.attention_backends``; the platform resolves it there by name
(``token_major``) and hands vLLM the class's qualified name.
"""
