"""Offline batch generation with ``vllm.LLM`` on the Spyre plugin.

Nothing here is Spyre-specific: with the plugin installed, vLLM picks the Spyre
platform by itself (the card when one is present, else the cpu target).

    python examples/offline_generate.py                        # the embedded SmolLM2
    python examples/offline_generate.py --enforce-eager        # skip compilation
    python examples/offline_generate.py --model /path/to/model --dtype float32

Every ``vllm.EngineArgs`` option (``vllm serve`` flags) is accepted. Sampling is
greedy unless ``--temperature`` is given. ``--json-out FILE`` also writes the
prompts, texts and token ids as JSON (the CI test compares them with Hugging
Face transformers).
"""

from __future__ import annotations

from typing import Any

import offline_cli  # examples/offline_cli.py: the command line the offline examples share
from vllm import LLM, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Three facts about bees:",
]


def create_parser() -> FlexibleArgumentParser:
    # Every vllm.EngineArgs flag, with CPU-sized limits (the same as scripts/serve.sh)
    # that every flag overrides, and the options of the "example" group.
    return offline_cli.create_parser(
        __doc__,
        json_out_help="also write the results here as JSON",
        max_tokens=32,
        **offline_cli.CPU_LIMITS,
    )


def main(args: dict[str, Any]) -> None:
    options = offline_cli.pop_example_options(args)
    args["model"] = args["model"] or offline_cli.embedded_smollm2()

    llm = LLM(**args)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature)
    outputs = llm.generate(PROMPTS, params)

    results = []
    print("-" * 60)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt:    {output.prompt!r}\nGenerated: {completion.text!r}")
        print("-" * 60)
        results.append(
            {
                "prompt": output.prompt,
                "text": completion.text,
                "prompt_token_ids": list(output.prompt_token_ids or []),
                "token_ids": list(completion.token_ids),
            }
        )
    options.write_json(results)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
