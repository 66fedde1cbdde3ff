"""Drives a gateway with OpenAI's official Python client, as an application would.

Usage: openai_client.py BASE_URL MODEL

Chat and completions, whole and streamed (the chat stream with its usage chunk), and one
request the engine refuses (a prompt past its context); prints one JSON object of what came
back, for the calling test to check.
"""

import json
import sys

import openai
from openai import OpenAI


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = {}

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=8,
        temperature=0,
    )
    out["chat"] = {
        "text": chat.choices[0].message.content,
        "prompt_tokens": chat.usage.prompt_tokens,
        "completion_tokens": chat.usage.completion_tokens,
    }

    text, usage = "", None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    out["chat_stream"] = {
        "text": text,
        "completion_tokens": usage.completion_tokens if usage else None,
    }

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    out["completion"] = {"text": completion.choices[0].text}

    streamed = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
    )
    out["completion_stream"] = {
        "text": "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    }

    try:
        client.completions.create(model=model, prompt="word " * 1500, max_tokens=4)
        out["error"] = None
    except openai.APIStatusError as error:
        out["error"] = {"status": error.status_code, "message": error.message}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
