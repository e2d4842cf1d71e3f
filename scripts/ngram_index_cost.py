"""The prompt-lookup proposer's host cost per request: the first lookup, which indexes the whole
prompt, the per-step lookup after it, and the memory its index holds, at several prompt lengths.

    python scripts/ngram_index_cost.py [--out FILE.json] [--label TEXT]

Prompts are random tokens from a 49,152-token vocabulary (the embedded model's), so nearly every
n-gram is distinct: the index's worst case. Time is the best of 3 (the first lookup on a fresh
proposer each time); memory is what tracemalloc sees allocated by the first lookup and still
held (numpy reports its buffers to tracemalloc), in a separate run from the timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
import tracemalloc
from pathlib import Path

from kvcap.engine.ngram import NgramProposer
from kvcap.engine.request import Request
from kvcap.sampling_params import SamplingParams

LENGTHS = (1024, 8192, 32768, 131072)


def _request(n: int, seed: int) -> Request:
    rng = random.Random(seed)
    return Request("r", [rng.randrange(49152) for _ in range(n)], SamplingParams(max_tokens=512))


def measure(n: int) -> dict:
    index_s = []
    for rep in range(3):
        req, p = _request(n, rep), NgramProposer(4, 4, 2)
        t = time.perf_counter()
        p.propose(req, 4)
        index_s.append(time.perf_counter() - t)
    rng = random.Random(7)
    t = time.perf_counter()
    for _ in range(256):  # one new token a step, as in decode
        req.output_token_ids.append(rng.randrange(49152))
        p.propose(req, 4)
    step_s = (time.perf_counter() - t) / 256
    req, p = _request(n, 0), NgramProposer(4, 4, 2)
    tracemalloc.start()
    p.propose(req, 4)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"prompt_tokens": n, "index_ms": round(min(index_s) * 1e3, 2),
            "step_us": round(step_s * 1e6, 2), "held_mib": round(held / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rows = [measure(n) for n in LENGTHS]
    print(f"{'prompt':>8} {'index ms':>9} {'step us':>8} {'held MiB':>9}")
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['index_ms']:>9.2f} {r['step_us']:>8.2f} "
              f"{r['held_mib']:>9.2f}")
    if args.out:
        from kvcap.bench.provenance import stamp

        result = {"bench": "ngram_index_cost", "label": args.label, **stamp(),
                  "cpu": platform.processor() or platform.machine(),
                  "max_n": 4, "min_n": 2, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
