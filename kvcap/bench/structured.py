"""Host cost of structured output: ``python -m kvcap.bench.structured [--model M] [--out F]``.

Structured output (kvcap/engine/structured.py) checks each sampled token of a constrained row
on the host, and only after MAX_REJECTIONS misses builds a whole-vocabulary mask. This
measures, with the model's real tokenizer (default: the embedded model's 49,152 tokens):
  * `check_us`: microseconds to check one token, over the tokens of documents that follow
    each grammar (JSON mode, a nested schema with enums and bounds, a recursive schema, a
    record of patterns, formats, bounded numbers and a tuple, counts under keys by pattern
    and name rules), the grammar's step cache cold (first document) and warm (later ones);
  * `mask_ms`: milliseconds for a full mask at states of each kind (before a key, inside a
    key, inside a number, inside a string value; after a gc.collect(), so that a full
    collection the growth of the grammar's caches sets off is not counted), and the one-off
    sort of the vocabulary;
  * `compile_ms`: compiling each schema.
Pure host work: no model weights are loaded; CPU time on this machine is what a GPU server's
host thread pays per constrained row per step. JSON (with date, commit, CPU) to
docs/benchmarks/structured-<date>.json (``-2``, ... when taken) or the ``--out`` file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import re
import statistics
import time
from pathlib import Path

from kvcap.bench.provenance import result_path, stamp
from kvcap.commands.common import positive_int
from kvcap.engine.structured import StructuredOutput
from kvcap.engine.token_bytes import TokenTexts
from kvcap.sampling import json_schema
from kvcap.scales.fsutil import atomic_write_text

PET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "kind": {"enum": ["cat", "dog", "parrot"]},
    "age": {"type": ["integer", "null"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                               "verified": {"type": "boolean"}},
              "required": ["name"]}},
    "required": ["name", "kind"]}
TREE = {"$defs": {"n": {"type": "object", "properties": {
    "value": {"type": "number"}, "children": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
    "required": ["value"]}}, "$ref": "#/$defs/n"}
RECORD = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
    "note": {"type": "string", "pattern": "(ok|late)", "maxLength": 24},
    "day": {"type": "string", "format": "date"},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
    "count": {"type": "integer", "minimum": 1, "maximum": 999},
    "pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": -50},
                                              {"type": "boolean"}], "items": False}},
    "required": ["code", "note", "day", "score", "count", "pair"]}
# other keys by pattern and name rules (pydantic's dict with constrained keys), a declared one
KEYS = {"type": "object", "properties": {"total": {"type": "integer", "minimum": 0}},
        "required": ["total"],
        "patternProperties": {"^[a-z]+_count$": {"type": "integer", "minimum": 0}},
        "propertyNames": {"maxLength": 24}}
FRUIT = ["apple", "pear", "plum", "cherry", "quince", "fig"]
WORDS = ["Tom", "Whiskers", "a very old cat", "\u00e9t\u00e9", "fluffy", "indoor", "likes fish"]


def _pet(rng: random.Random) -> dict:
    return {"name": rng.choice(WORDS), "kind": rng.choice(["cat", "dog", "parrot"]),
            "age": rng.choice([None, rng.randint(0, 30)]),
            "tags": rng.sample(WORDS, rng.randint(0, 4)),
            "owner": {"name": rng.choice(WORDS), "verified": rng.random() < 0.5}}


def _tree(rng: random.Random, depth: int = 0) -> dict:
    kids = [_tree(rng, depth + 1) for _ in range(rng.randint(0, 3 if depth < 2 else 0))]
    return {"value": round(rng.uniform(-100, 100), rng.randint(0, 4)), "children": kids}


def _record(rng: random.Random) -> dict:
    return {"code": f"{rng.choice(['AB', 'XY', 'QZ'])}-{rng.randint(0, 9999):04d}",
            "note": f"{rng.choice(['was ', 'all ', ''])}{rng.choice(['ok', 'late'])}",
            "day": f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "score": round(rng.uniform(0.5, 100), rng.randint(0, 3)),
            "count": rng.randint(1, 999), "pair": [rng.randint(-50, 500), rng.random() < 0.5]}


def _counts(rng: random.Random) -> dict:
    doc = {f"{f}_count": rng.randint(0, 40) for f in rng.sample(FRUIT, rng.randint(1, 4))}
    return doc | {"total": sum(doc.values())}


def documents(n: int, seed: int = 0) -> dict[str, tuple[object, list[str]]]:
    """name -> (schema, documents valid under it), generated deterministically."""
    rng = random.Random(seed)
    pets = [json.dumps(_pet(rng), ensure_ascii=False, indent=rng.choice([None, 2]))
            for _ in range(n)]
    trees = [json.dumps(_tree(rng)) for _ in range(n)]
    records = [json.dumps(_record(rng), indent=rng.choice([None, 2])) for _ in range(n)]
    counts = [json.dumps(_counts(rng), indent=rng.choice([None, 2])) for _ in range(n)]
    return {"json_object": ({"type": "object"}, pets), "pet_schema": (PET, pets),
            "tree_schema": (TREE, trees), "record_schema": (RECORD, records),
            "keys_schema": (KEYS, counts)}


def time_checks(so: StructuredOutput, grammar, ids: list[int]) -> tuple[float, int]:
    """Seconds to check every token of one document in turn, and the token count."""
    state = grammar.start
    t0 = time.perf_counter()
    for tok in ids:
        state = so.next_state(grammar, state, tok)
        if state is None:
            raise AssertionError("a valid document was refused")
    took = time.perf_counter() - t0
    if not grammar.complete(state):
        raise AssertionError("a valid document did not complete")
    return took, len(ids)


def doc_count(text: str) -> int:
    """--docs: the first document is timed with the step cache cold, the others warm, so at
    least 2 (1 had no warm time to take the median of; 0 no document at all)."""
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (the first document is timed cold, "
                                         f"the others warm), got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="whose tokenizer (default: embedded)")
    ap.add_argument("--docs", type=doc_count, default=30, help="documents per grammar (>= 2)")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    from kvcap.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(args.model))
    texts = TokenTexts(tok)
    vocab = len(tok)
    so = StructuredOutput(texts, vocab, {tok.eos_token_id} if tok.eos_token_id is not None
                          else set())
    t0 = time.perf_counter()
    so._vocab_walk()
    walk_s = time.perf_counter() - t0
    rows = []
    for name, (schema, docs) in documents(args.docs).items():
        t0 = time.perf_counter()
        json_schema._compile_text.cache_clear()
        grammar = json_schema.compile_schema(schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        per_doc = [time_checks(so, grammar, tok.encode(d, add_special_tokens=False))
                   for d in docs]
        cold = per_doc[0][0] / per_doc[0][1] * 1e6
        warm = [s / n * 1e6 for s, n in per_doc[1:]]
        masks = {}
        for label, cut in (("before_key", lambda d: d.index('"')),
                           ("in_string", lambda d: d.index('"') + 2),
                           ("in_number", _number_cut),
                           ("in_value", _value_cut)):
            doc = next((d for d in docs if cut(d) is not None), None)
            if doc is None:  # no state of this kind in these documents (a tree's values)
                continue
            prefix = doc[:cut(doc)].encode()
            state = grammar.feed(grammar.start, prefix)
            so._masks.clear()
            gc.collect()  # a collection the caches' growth triggers is not the mask's cost
            t0 = time.perf_counter()
            allowed = so.mask(grammar, state)
            masks[label] = {"ms": round((time.perf_counter() - t0) * 1e3, 2),
                            "tokens_allowed": int(allowed.sum()), "prefix": prefix.decode()}
        rows.append({"grammar": name, "compile_ms": round(compile_ms, 3),
                     "tokens_checked": sum(n for _, n in per_doc),
                     "check_us_cold": round(cold, 2),
                     "check_us_warm_median": round(statistics.median(warm), 2),
                     "mask": masks})
    date = datetime.date.today().isoformat()
    result = {"bench": "structured", "date": date, **stamp(), "cpu": platform.processor() or
              platform.machine(), "python": platform.python_version(), "model": args.model,
              "vocab": vocab, "vocab_walk_build_s": round(walk_s, 3), "rows": rows}
    out = result_path(Path(args.out), f"structured-{date}")
    atomic_write_text(out, json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"structured output host cost, {args.model} tokenizer ({vocab} tokens); vocabulary "
          f"sort {walk_s:.2f} s once")
    print(f"{'grammar':>13} {'compile ms':>10} {'check us cold':>13} {'warm':>7} "
          f"{'mask ms: key':>12} {'in key':>7} {'number':>7} {'value':>7}")
    for r in rows:
        m = {k: {"ms": float("nan")} for k in ("in_number", "in_value")} | r["mask"]
        print(f"{r['grammar']:>13} {r['compile_ms']:>10.2f} {r['check_us_cold']:>13.1f} "
              f"{r['check_us_warm_median']:>7.1f} {m['before_key']['ms']:>12.1f} "
              f"{m['in_string']['ms']:>7.1f} {m['in_number']['ms']:>7.1f} "
              f"{m['in_value']['ms']:>7.1f}")
    print(f"wrote {out}")
    return 0


def _value_cut(doc: str) -> int | None:
    """Two characters into the document's first string value (None: none)."""
    at = doc.find(': "')
    return None if at < 0 else at + 5


def _number_cut(doc: str) -> int | None:
    """Just after the first digit of the document's first number, a value or an array item
    (None: no number)."""
    hit = re.search(r"[:\[,]\s*-?[0-9]", doc)
    return None if hit is None else hit.end()


if __name__ == "__main__":
    raise SystemExit(main())
