"""Host time of the Triton backend's attention per layer, with the kernel launches stubbed out:
kvcap's own Python (checks, route, launch configuration, buffers) for one mixed step -- 16
decode rows at 1,000 tokens beside a 64-token prefill chunk, E4M3 cache, the 8B shape's heads
-- over 32 layers, a new step's metadata each time. Runs on the CPU; Triton's own launch cost
is not in it (the stubs replace `kernel[grid](...)`).

    python scripts/attention_host_cost.py [--steps 50]
"""

from __future__ import annotations

import argparse
import time

import torch

import kvcap.kernels.decode as decode
import kvcap.kernels.prefill as prefill
from kvcap.attention.metadata import AttentionMetadata
from kvcap.attention.triton_backend import TritonBackend
from kvcap.kv_cache.pool import LayerKVCache


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    decode._decode_kernel = decode._merge_kernel = prefill._prefill_kernel = _NoLaunch()
    hq, hkv, d, bs, layers = 32, 8, 128, 16, 32
    qlens, seqs = [1] * 16 + [64], [1000] * 16 + [200]
    tables = [list(range(i * 70, i * 70 + 70)) for i in range(len(qlens))]
    cpu = torch.device("cpu")
    q = torch.randn(sum(qlens), hq, d)
    out = torch.empty_like(q)
    caches = [LayerKVCache(i, torch.zeros(1300, hkv, bs, d, dtype=torch.uint8),
                           torch.zeros(1300, hkv, bs, d, dtype=torch.uint8), "fp8_e4m3",
                           torch.tensor(0.5), torch.tensor(0.25)) for i in range(layers)]
    backend = TritonBackend()

    def step() -> float:
        meta = AttentionMetadata.build(qlens, seqs, tables, bs, cpu)
        t = time.perf_counter()
        for cache in caches:
            backend.attend_stored(q, cache, meta, d**-0.5, out)
        return time.perf_counter() - t

    step()
    spent = sum(step() for _ in range(args.steps))
    print(f"attention host work: {spent / args.steps / layers * 1e6:.1f} us per layer "
          f"({layers} layers, {args.steps} steps)")


if __name__ == "__main__":
    main()
