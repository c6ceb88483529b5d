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

from typing import Any

import offline_cli  # examples/offline_cli.py: the command line the offline examples share
from vllm import LLM, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

SYSTEM = "You are a concise assistant. Answer in one sentence."
QUESTIONS = [
    "What is the capital of France?",
    "And what river flows through it?",
]


def create_parser() -> FlexibleArgumentParser:
    return offline_cli.create_parser(
        __doc__,
        json_out_help="also write the turns here as JSON",
        max_tokens=48,
        **offline_cli.CPU_LIMITS,
    )


def main(args: dict[str, Any]) -> None:
    options = offline_cli.pop_example_options(args)
    args["model"] = args["model"] or offline_cli.embedded_smollm2()

    llm = LLM(**args)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature)
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
    options.write_json(turns)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
