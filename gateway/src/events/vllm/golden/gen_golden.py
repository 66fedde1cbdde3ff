"""Produce golden msgspec payloads for the Rust decoder tests.

The struct declarations mirror vllm/distributed/kv_events.py (vllm-project/vllm):
 - "current": events are tagged maps (vLLM PR #42892, e.g. 0.26.x), batch positional.
 - "legacy":  events are tagged arrays (array_like=True), as before #42892.
Run: ./venv/bin/python gen_golden.py  (writes golden/*.hex)
"""
from typing import Any

import msgspec


def make(events_array_like: bool):
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=events_array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def batch(mod, hashes, parent):
    EventBatch, BlockStored, BlockRemoved, AllBlocksCleared = mod
    return EventBatch(
        ts=1789095808.8378847,
        events=[
            BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(100, 132)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockRemoved(block_hashes=hashes[:1], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


if __name__ == "__main__":
    enc = msgspec.msgpack.Encoder()
    ints = [15760518052499183552, -5]
    byts = [b"\x00" * 24 + b"\x11" * 8, b"\xaa" * 24 + b"\x22" * 8]
    out = {
        "map": enc.encode(batch(make(False), ints, None)),
        "array": enc.encode(batch(make(True), ints, None)),
        "map_bytes": enc.encode(batch(make(False), byts, b"\x09" * 24 + b"\x03" * 8)),
    }
    # "plain": only the fields the Rust VllmEvent models (extra_keys left at its default), used
    # for byte-for-byte comparison with the Rust encoder in publisher.rs.
    for name, ea in (("plain_map", False), ("plain_array", True)):
        EB, BS, BR, AC = make(ea)
        h = [15760518052499183552, 77]
        out[name] = enc.encode(EB(ts=1789095808.8378847, events=[
            BS(block_hashes=h, parent_block_hash=None, token_ids=list(range(100, 132)), block_size=16,
               lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
            BR(block_hashes=h[:1], medium="GPU", group_idx=0),
            AC(),
        ], data_parallel_rank=0))
    for name, payload in out.items():
        open(f"golden/{name}.hex", "w").write(payload.hex() + "\n")
        print(name, len(payload), msgspec.msgpack.decode(payload))
