#!/usr/bin/env python3
"""The native worker binary on a GPU, end to end (run by scripts/gpu-check.sh).

Starts `switchyard-llm` twice on the same model, `--device cpu` and `--device cuda:0`, sends
each the same greedy chat requests (whole and streamed, a shared prefix so the second hits the
prefix cache) and fails unless both devices give the same tokens. Standard library only: the GPU
machine has no Rust and nothing to fetch.

usage: gpu-worker-smoke.py WORKER_BINARY MODEL_DIR [KV_CACHE_DTYPE]

KV_CACHE_DTYPE (`f32`, the default, or `f16`) is passed to both workers as `--kv-cache-dtype`.
"""

import json
import re
import subprocess
import sys
import time
import urllib.request


def start(binary, model, device, kv_dtype):
    process = subprocess.Popen(
        [binary, "--model", model, "--device", device, "--port", "0", "--served-model-name", "tiny",
         "--block-size", "4", "--kv-cache-mib", "16", "--threads", "2", "--kv-cache-dtype", kv_dtype],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = None
    deadline = time.time() + 30
    for line in process.stdout:
        print(f"[{device}] {line}", end="")
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            address = found.group(1)
        if "worker ready" in line:
            break
        if time.time() > deadline:
            break
    if address is None or process.poll() is not None:
        process.kill()
        sys.exit(f"{device}: the worker did not start")
    return process, address


def chat(address, content, stream):
    body = json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": content}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": stream,
    }).encode()
    request = urllib.request.Request(address + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    if not stream:
        return json.loads(text)["choices"][0]["message"]["content"]
    pieces = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            pieces.append(delta.get("content") or "")
    return "".join(pieces)


def main():
    binary, model = sys.argv[1], sys.argv[2]
    kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "f32"
    prompts = ["hello world, hello switchyard", "hello world, hello switchyard, and again",
               "a different question entirely"]
    answers = {}
    for device in ["cpu", "cuda:0"]:
        process, address = start(binary, model, device, kv_dtype)
        try:
            answers[device] = [chat(address, p, stream) for p in prompts for stream in (False, True)]
            with urllib.request.urlopen(address + "/metrics", timeout=10) as reply:
                metrics = reply.read().decode()
            print(f"[{device}] " + " ".join(
                line for line in metrics.splitlines() if "prefix" in line and not line.startswith("#")))
        finally:
            process.terminate()
            process.wait(timeout=20)
    for device, texts in answers.items():
        print(device, json.dumps(texts))
    if answers["cpu"] != answers["cuda:0"]:
        sys.exit("the GPU worker's greedy answers differ from the CPU worker's")
    print(f"cuda:0 answered {len(prompts) * 2} greedy requests with the CPU worker's tokens")


if __name__ == "__main__":
    main()
