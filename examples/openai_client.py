"""Talk to ``vllm serve`` with the official ``openai`` client.

Start a server first (any of these), then run this script::

    scripts/serve.sh                                   # the embedded SmolLM2 on :8000
    vllm serve /path/to/model --max-model-len 2048     # your own model

    python examples/openai_client.py                   # http://127.0.0.1:8000/v1
    python examples/openai_client.py --base-url http://127.0.0.1:8123/v1

It lists the served models, then asks one chat question twice, once as a
single response and once streamed token by token (greedy, so both must be the
same text), and runs one plain completion. ``--json-out FILE`` writes what it
received. Needs only ``pip install openai`` (no vLLM) on the client side.
"""

from __future__ import annotations

import argparse
import json
import sys

import openai


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="vllm serve --api-key, if set")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = [m.id for m in client.models.list().data]
    model = args.model or models[0]
    print(f"served models: {models}; using {model!r}")

    messages = [{"role": "user", "content": "Name the capital of France."}]
    kwargs = dict(model=model, messages=messages, max_tokens=args.max_tokens, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    answer = reply.choices[0].message.content or ""
    print(f"chat:      {answer!r} ({reply.usage.completion_tokens} tokens)")

    print("streamed:  ", end="", flush=True)
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    streamed = "".join(pieces)

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=args.max_tokens, temperature=0
    )
    print(f"completion: {completion.choices[0].text!r}")

    if args.json_out:
        result = {
            "models": models,
            "chat": answer,
            "chat_tokens": reply.usage.completion_tokens,
            "streamed": streamed,
            "completion": completion.choices[0].text,
        }
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=2)
    if streamed != answer:
        sys.exit("the streamed answer differs from the non-streamed one")


if __name__ == "__main__":
    main()
