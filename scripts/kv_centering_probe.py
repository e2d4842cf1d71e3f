"""Would subtracting a calibrated per-channel mean from K (and V) before E4M3 rounding close the
quality gap on the embedded model? (docs/fp8_kv.md, "What could close the gap".)

Softmax ignores a constant added to every score of a query, so storing `k - m` for a fixed
vector `m` (one per layer, KV head and channel, post-RoPE) gives exactly the same attention in
exact arithmetic, while the rounding error of E4M3 (relative to each stored value) shrinks
where a channel's mean dominates its values. For V the mean comes back as a constant term of
the output (attention weights sum to 1). This probe simulates both in HF transformers' FP32
model, outside the engine: a hook rounds post-RoPE K (`apply_rotary_pos_emb`) and V (`v_proj`)
through `torch.float8_e4m3fn` with per-layer scales `ceil_fp32(max_abs / 448)` of the stored
tensor, with and without the mean taken out (and added back, which is what the exact identity
makes equivalent). Means and scales come from calibration-split records, KL / top-1 from
evaluation-split records (kvcap.eval.corpora, disjoint by construction).

    python scripts/kv_centering_probe.py [CALIBRATION_TOKENS] [EVAL_TOKENS]   # 16384 4096
"""

from __future__ import annotations

import sys

import torch
import transformers.models.llama.modeling_llama as hf_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcap.eval.corpora import build_shards
from kvcap.models.loader import resolve_model_dir
from kvcap.scales.report import scale_for

HEAD_DIM = 64  # the embedded model's


def e4m3_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


class Probe:
    """Collects post-RoPE K / V per layer, then rounds them as an arm asks."""

    def __init__(self, model):
        self.layer, self.mode, self.which, self.center = 0, "collect", "", ""
        self.seen: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.means: dict[tuple[int, str], torch.Tensor] = {}
        self.scales: dict[tuple[int, str, bool], float] = {}
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._enter(i))
            layer.self_attn.v_proj.register_forward_hook(self._v)
        rope = hf_llama.apply_rotary_pos_emb

        def rope_then_k(q, k, cos, sin, *args, **kwargs):
            q, k = rope(q, k, cos, sin, *args, **kwargs)
            return q, self.treat("k", k)

        hf_llama.apply_rotary_pos_emb = rope_then_k

    def _enter(self, i):
        def hook(module, args):
            self.layer = i
        return hook

    def _v(self, module, inputs, out):
        b, t, _ = out.shape
        x = out.view(b, t, -1, HEAD_DIM).transpose(1, 2)
        return self.treat("v", x).transpose(1, 2).reshape(b, t, -1)

    def treat(self, name: str, x: torch.Tensor) -> torch.Tensor:  # x [B, H, T, D]
        key = (self.layer, name)
        if self.mode == "collect":
            self.seen.setdefault(key, []).append(x.detach())
            return x
        if self.mode == "reference" or name not in self.which:
            return x
        centered = name in self.center
        m = self.means[key] if centered else 0
        return e4m3_round_trip(x - m, self.scales[(*key, centered)]) + m

    def finish_calibration(self) -> None:
        for key, xs in self.seen.items():
            flat = torch.cat([x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in xs])
            m = flat.mean(0)[None, :, None, :]  # [1, H, 1, D]
            self.means[key] = m
            self.scales[(*key, False)] = scale_for(float(flat.abs().max()))
            self.scales[(*key, True)] = scale_for(float((flat - m[0, :, 0]).abs().max()))
            if key[1] == "k" and key[0] in (0, 9, 20, 29):
                share = float(m.pow(2).sum() / flat.pow(2).mean(0).sum())
                print(f"layer {key[0]:2d} K: the mean holds {share:.0%} of its energy")
        self.seen.clear()


def main(argv: list[str]) -> int:
    cal_tokens = int(argv[0]) if argv else 16384
    eval_tokens = int(argv[1]) if len(argv) > 1 else 4096
    torch.manual_seed(0)
    model_dir = resolve_model_dir("default")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    probe = Probe(model)
    with torch.no_grad():
        for shard in build_shards(tok, max_tokens=cal_tokens, split="calibration",
                                  progress=False):
            for ids in shard.records:
                model(torch.tensor([ids]))
    probe.finish_calibration()
    records = [ids for shard in build_shards(tok, max_tokens=eval_tokens, split="evaluation",
                                             progress=False) for ids in shard.records]

    def logprobs(mode: str, which: str = "", center: str = "") -> list[torch.Tensor]:
        probe.mode, probe.which, probe.center = mode, which, center
        with torch.no_grad():
            return [model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
                    for ids in records]

    ref = logprobs("reference")
    n = sum(len(r) for r in ref)
    print(f"{cal_tokens} calibration tokens, {n} evaluation positions")
    print(f"{'arm':24} {'mean KL':>9} {'top-1':>7}")
    for label, which, center in (("K+V", "kv", ""), ("K+V, K centered", "kv", "k"),
                                 ("K+V, both centered", "kv", "kv"), ("K only", "k", ""),
                                 ("K only, centered", "k", "k"), ("V only", "v", ""),
                                 ("V only, centered", "v", "v")):
        arm = logprobs("round", which, center)
        kl = sum(float((r.exp() * (r - a)).sum()) for r, a in zip(ref, arm, strict=True)) / n
        top1 = sum(int((r.argmax(-1) == a.argmax(-1)).sum())
                   for r, a in zip(ref, arm, strict=True)) / n
        print(f"{label:24} {kl:9.3e} {top1:7.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
