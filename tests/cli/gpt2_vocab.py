"""GPT-2's byte-level BPE, the parts the tests share: its pre-tokenizing pattern (openai/gpt-2's
src/encoder.py, run by Debian's python3-regex), its byte-to-character table, and a small vocabulary
learnt from a corpus and written as GPT-2 publishes it (vocab.json, merges.txt)."""
import collections
import json

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_table():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTES = byte_table()
UNBYTES = {c: b for b, c in BYTES.items()}


def pieces(text):
    return ["".join(BYTES[b] for b in p.encode("utf-8")) for p in PATTERN.findall(text)]


def learn(texts, merges_wanted):
    """Merges by frequency over the pieces of `texts` (ties broken by the pair's text)."""
    words = collections.Counter(tuple(p) for t in texts for p in pieces(t))
    merges = []
    while len(merges) < merges_wanted:
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def vocabulary(merges):
    """GPT-2's numbering: the 256 bytes, each merge's result, then <|endoftext|>."""
    vocab = {c: i for i, c in enumerate(BYTES[b] for b in range(256))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def write_vocabulary(folder, vocab, merges):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
