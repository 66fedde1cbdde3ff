#!/usr/bin/env python3
"""Writes the hand-made seed inputs of the fuzz targets into corpus/<target>/seed-*.

Seeds are valid inputs of each format, so that the fuzzers start from deep in the parsers;
the rest of each committed corpus is what `cargo fuzz cmin` kept from runs. Standard library
only: a minimal msgpack encoder, GGUF and safetensors writers.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    with open(os.path.join(CORPUS, target, "seed-" + name), "wb") as f:
        f.write(data)


def mp(value):
    """msgpack: None, bool, int, float, str, bytes, list, dict."""
    if value is None:
        return b"\xc0"
    if value is True:
        return b"\xc3"
    if value is False:
        return b"\xc2"
    if isinstance(value, int):
        if 0 <= value < 128:
            return bytes([value])
        if -32 <= value < 0:
            return struct.pack("b", value)
        if value >= 0:
            return b"\xcf" + struct.pack(">Q", value)
        return b"\xd3" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode()
        return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw
    if isinstance(value, bytes):
        return b"\xc4" + bytes([len(value)]) + value
    if isinstance(value, list):
        head = bytes([0x90 | len(value)]) if len(value) < 16 else b"\xdc" + struct.pack(">H", len(value))
        return head + b"".join(mp(v) for v in value)
    if isinstance(value, dict):
        head = bytes([0x80 | len(value)]) if len(value) < 16 else b"\xde" + struct.pack(">H", len(value))
        return head + b"".join(mp(k) + mp(v) for k, v in value.items())
    raise TypeError(value)


def frames(*parts):
    return b"".join(struct.pack("<H", len(p)) + p for p in parts)


def vllm():
    stored_map = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                  "token_ids": list(range(32)), "block_size": 16, "lora_id": None,
                  "medium": "GPU", "lora_name": None}
    stored_array = ["BlockStored", [13, -5], 12, list(range(32)), 16, None, "CPU"]
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    cleared = ["AllBlocksCleared"]
    bin_hash = {"type": "BlockStored", "block_hashes": [b"\x00" * 24 + b"\x01" * 8],
                "parent_block_hash": None, "token_ids": list(range(16)), "block_size": 16,
                "lora_id": None, "medium": None, "lora_name": None}
    batch = lambda seq, events: frames(b"", struct.pack(">Q", seq), mp([1.5, events, 0]))
    write("vllm_msgpack", "map-events", b"\x00" + batch(0, [stored_map, removed]))
    write("vllm_msgpack", "array-events", b"\x00" + batch(0, [stored_array]) + batch(1, [cleared]))
    write("vllm_msgpack", "bytes-hash", b"\x01" + batch(0, [bin_hash]) + batch(5, [removed]))
    envelope = {"ts": 2.0, "events": [stored_map], "data_parallel_rank": None}
    write("vllm_msgpack", "map-envelope", b"\x00" + frames(b"kv", struct.pack(">Q", 0), mp(envelope)))


def kv_json():
    def chain(n):
        # Not Switchyard's hashing: the index reports the mismatch and goes on.
        return [{"block_hash": 100 + i, "tokens_hash": 200 + i} for i in range(n)]
    events = [
        {"worker": "w0", "event_id": 1, "event": {"type": "stored", "parent": None, "blocks": chain(3)}},
        {"worker": "w0", "event_id": 2, "tier": "host", "event": {"type": "stored", "parent": 101, "blocks": chain(2)}},
        {"worker": "w0", "event_id": 3, "event": {"type": "removed", "block_hashes": [102]}},
        {"worker": "w0", "event_id": 4, "event": {"type": "cleared"}},
    ]
    write("kv_event_json", "posted", b"\x00" + json.dumps(events).encode())
    registration = {"worker": "w0", "url": "http://10.0.0.1:8000", "model": "m", "role": "vision",
                    "block_size": 16, "capacity_blocks": 1024, "capabilities": ["image"], "cost": 0.5,
                    "node": "n1", "token_budgets": [256, 1024], "heartbeat_ms": 1000, "last_event_id": 0}
    write("kv_event_json", "registration", b"\x01" + json.dumps(registration).encode())
    write("kv_event_json", "nats-event", b"\x02" + json.dumps(events[0]).encode())
    dump = {"worker": "w0", "last_event_id": 9, "blocks": [
        {"block_hash": 100, "parent": None, "tokens_hash": 200},
        {"block_hash": 101, "parent": 100, "tokens_hash": 201, "tier": "host"}]}
    write("kv_event_json", "dump", b"\x03" + json.dumps(dump).encode())


def gguf():
    def string(s):
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    def kv(key, kind, payload):
        return string(key) + struct.pack("<I", kind) + payload

    u32 = lambda v: struct.pack("<I", v)
    metadata = [
        kv("general.architecture", 8, string("llama")),
        kv("general.alignment", 4, u32(32)),
        kv("llama.embedding_length", 4, u32(8)),
        kv("llama.feed_forward_length", 4, u32(16)),
        kv("llama.block_count", 4, u32(1)),
        kv("llama.attention.head_count", 4, u32(2)),
        kv("llama.attention.head_count_kv", 4, u32(1)),
        kv("llama.context_length", 4, u32(64)),
        kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
        kv("tokenizer.ggml.model", 8, string("gpt2")),
        kv("tokenizer.ggml.tokens", 9, u32(8) + struct.pack("<Q", 4) + b"".join(string(t) for t in ["a", "b", "ab", "<s>"])),
        kv("tokenizer.ggml.merges", 9, u32(8) + struct.pack("<Q", 1) + string("a b")),
        kv("tokenizer.chat_template", 8, string("{% for m in messages %}{{ m['content'] }}{% endfor %}")),
    ]
    tensors = [("token_embd.weight", [8, 4], 0), ("output_norm.weight", [8], 1)]
    header = b"GGUF" + u32(3) + struct.pack("<Q", len(tensors)) + struct.pack("<Q", len(metadata)) + b"".join(metadata)
    data = b""
    infos = b""
    for name, dims, kind in tensors:
        count = 1
        for d in dims:
            count *= d
        infos += string(name) + u32(len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += u32(kind) + struct.pack("<Q", len(data))
        size = count * (4 if kind == 0 else 2)
        data += bytes(range(size % 256)) * (size // 256) + bytes(range(size % 256))
        data += b"\x00" * ((-len(data)) % 32)
    head = header + infos
    head += b"\x00" * ((-len(head)) % 32)
    write("gguf_header", "llama", head + data)


def safetensors():
    tensors = {"a": ("F32", [2, 3]), "b": ("F16", [4]), "c": ("BF16", [1, 2]), "d": ("I64", [1])}
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    write("safetensors_header", "mixed", struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(offset)))


def openai():
    chat = {"model": "m", "stream": True, "max_tokens": 16, "temperature": 0.5,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [
                             {"type": "text", "text": "what is this?"},
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="}},
                             {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YQAAAAA=", "format": "wav"}}]}]}
    write("openai_request", "chat-media", b"\x00" + json.dumps(chat).encode())
    completion = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "stop": ["\n"], "n": 1}
    write("openai_request", "completion", b"\x01" + json.dumps(completion).encode())


def tenants():
    key = "a" * 64
    one = f'[[api_keys]]\nkey_sha256 = "{key}"\ntenant = "acme"\n'
    write("tenants_keys_file", "one-key", one.encode())
    limits = (one + 'models = ["small", "large"]\npriority = 2\nrequests_per_minute = 60\n'
              'tokens_per_minute = 100000\nmonthly_tokens = 5000000\nweight = 2.5\n'
              f'\n[[api_keys]]\nkey_sha256 = "{"0123456789abcdef" * 4}"\ntenant = "acme"\n'
              'models = ["small"]\nrequests_per_minute = 60\ntokens_per_minute = 100000\n'
              'monthly_tokens = 5000000\nweight = 2.5\n')
    write("tenants_keys_file", "limits", limits.encode())
    write("tenants_keys_file", "empty", b"")
    write("tenants_keys_file", "twice", (one + one).encode())


def planner_window():
    # Arbitrary-decoded observation lists: the bytes pick variants and values.
    write("planner_window", "mixed", bytes(range(0, 256, 3)) * 2)
    write("planner_window", "closes", bytes([3, 2, 0, 1]) * 16)
    write("planner_window", "samples", bytes([2, 1]) + struct.pack("<dd", 0.5, 128.0) * 8 + bytes([3, 1, 1]))


if __name__ == "__main__":
    vllm()
    kv_json()
    gguf()
    safetensors()
    openai()
    tenants()
    planner_window()
