"""Token shards as tk-tokenize writes them (llm.c's format): a 1024-byte header of 256 int32
(magic 20240520, version 1 for uint16 tokens or 2 for uint32, the token count), then the tokens."""
import pathlib
import struct


def read_shard(path):
    """The tokens of the shard at `path`, checking its header and its length."""
    raw = pathlib.Path(path).read_bytes()
    magic, version, count = struct.unpack("<3i", raw[:12])
    assert magic == 20240520, (path, magic)
    width = {1: 2, 2: 4}[version]
    assert len(raw) == 1024 + width * count, (path, len(raw), count)
    return list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", raw[1024:]))
