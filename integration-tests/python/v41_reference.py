"""DeepSeek V4.1's Engram token map and row addresses, computed the way the
engines compute them (vLLM's `build_compressed_token_map`,
`compute_hash_multipliers` and `EngramLayout`), with the `tokenizers`
library's own normalizers and numpy's generator. It shares no code with
the Rust side: the tests run it beside `inference-node` and compare.

Usage: v41_reference.py TOKENIZER_JSON TEXTS_JSON [--no-map]
  TEXTS_JSON: a JSON list of strings, or an object with a "texts" list
  of objects with a "text" (this script's own output).
Prints one JSON object: the raw and compressed vocabulary sizes, the pad's
compressed id, the multipliers, the tables' row counts, the whole map
(unless --no-map), and for each text its token ids (encoded without
special tokens), compressed ids and the 24 row ids of each layer at each
position.
"""

import json
import sys

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

LAYERS = (1, 14)
MAX_NGRAM = 4
HEADS = 8
BASE = 16_000_000
PAD_RAW = 2


def token_map(tok):
    sentinel = "\ue000"
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    key_to_new = {}
    lookup = []
    for t in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(t)
        else:
            n = norm.normalize_str(text)
            key = n if n else text
        lookup.append(key_to_new.setdefault(key, len(key_to_new)))
    return lookup, len(key_to_new)


def multipliers(vocab):
    bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    out = []
    for layer in LAYERS:
        g = np.random.default_rng(10007 * layer)
        v = g.integers(low=0, high=bound, size=(MAX_NGRAM,), dtype=np.int64)
        out.append([int(x) * 2 + 1 for x in v])
    return out


def is_prime(n):
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def primes():
    seen = set()
    layers = []
    for _ in LAYERS:
        cols = []
        for _ in range(MAX_NGRAM - 1):
            current = BASE - 1
            for _ in range(HEADS):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                cols.append(current)
        layers.append(cols)
    return layers


def rows(ids, pad, mult, layer_primes):
    offsets = np.cumsum([0] + layer_primes[:-1]).tolist()
    out = []
    for p in range(len(ids)):
        h = 0
        cols = []
        for k in range(MAX_NGRAM):
            x = ids[p - k] if p - k >= 0 else pad
            h ^= x * mult[k]
            if k > 0:
                for head in range(HEADS):
                    c = (k - 1) * HEADS + head
                    cols.append(h % layer_primes[c] + offsets[c])
        out.append(cols)
    return out


def main():
    tok = Tokenizer.from_file(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        texts = json.load(f)
    if isinstance(texts, dict):
        texts = [t["text"] for t in texts["texts"]]
    lookup, vocab = token_map(tok)
    pad = lookup[PAD_RAW]
    mult = multipliers(vocab)
    layer_primes = primes()
    results = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        comp = [lookup[i] for i in ids]
        results.append(
            {
                "text": text,
                "ids": ids,
                "compressed": comp,
                "rows": {
                    str(layer): rows(comp, pad, mult[i], layer_primes[i])
                    for i, layer in enumerate(LAYERS)
                },
            }
        )
    out = {
        "raw_vocab": len(lookup),
        "compressed_vocab": vocab,
        "pad": pad,
        "multipliers": mult,
        "rows": [sum(p) for p in layer_primes],
        "texts": results,
    }
    if "--no-map" not in sys.argv[3:]:
        out["map"] = lookup
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
