"""pytest plugin for vLLM's own sampler tests: the platform's kernel overrides.

vLLM's workers call ``current_platform.register_triton_kernel_overrides()``
at start-up; a bare pytest run of its test files does not, so this plugin
does it once the session is configured.
"""


def pytest_configure(config):
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
