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

from typing import Any

import offline_cli  # examples/offline_cli.py: the command line the offline examples share
from vllm import LLM, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = [
    "The capital of France is",
    "Tensor parallelism splits each layer",
    "Once upon a time",
]


def create_parser() -> FlexibleArgumentParser:
    # No default --tensor-parallel-size: main() picks one that suits the model.
    return offline_cli.create_parser(
        __doc__,
        json_out_help="also write the results here as JSON",
        max_tokens=32,
        tensor_parallel_size=None,
        **offline_cli.CPU_LIMITS,
    )


def main(args: dict[str, Any]) -> None:
    options = offline_cli.pop_example_options(args)
    if not args["model"]:
        args["model"] = offline_cli.embedded_smollm2()
        args["tensor_parallel_size"] = args["tensor_parallel_size"] or 3
    args["tensor_parallel_size"] = args["tensor_parallel_size"] or 2

    llm = LLM(**args)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature)
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
    options.write_json(results)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
