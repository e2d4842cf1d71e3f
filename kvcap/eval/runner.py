"""`run_compare`: validate everything cheap first, then run the A/B tasks and write the report.

Order: tasks/contexts/overlay binding/control pack/calibration manifest are all checked before
any model is loaded, so bad input fails in seconds. Then the arms are loaded together and every
task feeds them the same token ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcap.errors import ConfigError
from kvcap.eval import (
    ab,
    corpora,
    disjoint,
    generation,
    heldout,
    plots,
    qsa_quality,
    report,
    retrieval,
)
from kvcap.scales.fsutil import lies_within, make_dirs

logger = logging.getLogger(__name__)

TASKS = ("heldout", "internals", "generation", "retrieval")
QSA_TASK = "qsa"  # added by --qsa PRESET (kvcap/eval/qsa_quality.py)


@dataclass(frozen=True)
class Budget:
    heldout_tokens: int
    record_tokens: int
    plain_prompts: int
    chat_prompts: int
    max_new_tokens: int
    contexts: tuple[int, ...]
    depths: tuple[int, ...] = retrieval.DEPTHS
    retrieval_tasks: tuple[str, ...] = retrieval.TASKS
    qsa_records: int = 1
    qsa_context: int | None = None  # None: twice the QSA token budget, capped to the window


QUICK = Budget(heldout_tokens=2048, record_tokens=256, plain_prompts=2, chat_prompts=2,
               max_new_tokens=128, contexts=(1024,), qsa_records=1)
FULL = Budget(heldout_tokens=16384, record_tokens=512, plain_prompts=8, chat_prompts=8,
              max_new_tokens=128, contexts=(1024, 2048, 4096, 8192), qsa_records=4)
HELDOUT_SHARDS = ["prose", "code", "chat", "tool_json"]


@dataclass
class CompareConfig:
    model: str = "default"
    overlay: Path | None = None
    out: Path = Path("kvcap-compare")
    tasks: tuple[str, ...] = TASKS
    quick: bool = False
    control: Path | None = None  # None: build a unit-scale control pack under `out`
    no_control: bool = False
    calibration_manifest: Path | None = None
    baseline_kv: str = "auto"  # the model dtype: fp32 on CPU, bf16/fp16 on GPU
    device: str | None = None
    seed: int = 0
    budget: Budget | None = None
    qsa: str | None = None  # a QSA preset (kvcap.qsa.enable.parse_preset) for every arm
    overrides: dict[str, Any] = field(default_factory=dict)  # Budget fields from the CLI


def parse_tasks(spec: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    items = spec.split(",") if isinstance(spec, str) else [s for x in spec for s in x.split(",")]
    names = tuple(dict.fromkeys(s.strip() for s in items if s.strip()))
    bad = [n for n in names if n not in (*TASKS, QSA_TASK)]
    if bad or not names:
        raise ConfigError(f"unknown task {', '.join(bad) or '(none)'}: choose from "
                          f"{', '.join((*TASKS, QSA_TASK))}")
    return names


def _resolve(cfg: CompareConfig) -> tuple[Path, Any, Budget]:
    from kvcap.models import loader

    if cfg.overlay is None:
        raise ConfigError("compare needs --overlay PACK (a calibrated scale overlay)")
    if cfg.baseline_kv not in ab.BASELINE_KV:  # before --out gets a control pack written
        raise ConfigError(f"baseline KV dtype {cfg.baseline_kv!r} is not one of "
                          f"{', '.join(ab.BASELINE_KV)}")
    if not Path(cfg.overlay).is_dir():
        raise ConfigError(f"overlay {cfg.overlay} is not a directory")
    base = loader.resolve_model_dir(cfg.model)
    spec = loader.read_spec(base)
    budget = cfg.budget or (QUICK if cfg.quick else FULL)
    budget = Budget(**{**asdict(budget), **cfg.overrides})
    window = spec.position_limit
    if "retrieval" in cfg.tasks:
        budget = Budget(**{**asdict(budget), "contexts": tuple(
            retrieval.validate_contexts(budget.contexts, window))})
        if not budget.retrieval_tasks:  # zero cases would score 0/0 as "no regressions"
            raise ConfigError(f"no retrieval task given: choose from {', '.join(retrieval.TASKS)}"
                              " or drop retrieval from --tasks")
        for t in budget.retrieval_tasks:
            if t not in retrieval.TASKS:
                raise ConfigError(f"unknown retrieval task {t!r}: choose from "
                                  f"{', '.join(retrieval.TASKS)}")
    # (build_shards refuses shorter records only after every arm has loaded; a held-out
    # budget below one record scored nothing and reported the goals as "not run")
    least = corpora.MIN_RECORD_TOKENS
    if "heldout" in cfg.tasks or "internals" in cfg.tasks:
        # (only where records are scored: --tasks generation on a 256-token model was refused
        # for the default record length of a task it did not run)
        if budget.record_tokens >= window:  # (a record is scored with one position after it)
            raise ConfigError(f"record length {budget.record_tokens} does not fit below the "
                              f"model's position limit {window}: pass --record-tokens "
                              f"{min(budget.record_tokens, window) // 2} or fewer")
        for flag, value in (("--record-tokens", budget.record_tokens),
                            ("--heldout-tokens", budget.heldout_tokens)):
            if value < least:
                raise ConfigError(f"{flag} {value} is below the shortest held-out record "
                                  f"({least} tokens): pass {least} or more")
    if QSA_TASK in cfg.tasks and cfg.qsa is None:
        raise ConfigError("the qsa task needs a QSA preset (kvcap compare --qsa PRESET)")
    # (without --qsa these were dropped without a word, and --qsa-context still sized every
    # arm's KV pool: --qsa-context 1000000 allocated a million-token pool per arm)
    stray = [f"--{k.replace('_', '-')}" for k in ("qsa_context", "qsa_records")
             if k in cfg.overrides]
    if cfg.qsa is None and stray:
        raise ConfigError(f"{' and '.join(stray)} need --qsa PRESET (they size the QSA "
                          "records only)")
    if cfg.qsa is not None:
        from kvcap.qsa.enable import parse_preset

        # a QSA record is scored like a held-out one, with one position after it: a record of
        # the whole window (the default where twice the budget reaches it) passed here and
        # failed after every arm had loaded ("prompt of N tokens does not fit")
        ctx = budget.qsa_context or min(2 * parse_preset(cfg.qsa).token_budget, window - 1)
        if ctx >= window:
            raise ConfigError(f"QSA context {ctx} exceeds the window {window} (a record is "
                              f"scored with one position after it): pass --qsa-context "
                              f"{window - 1} or fewer")
        if ctx < least:
            raise ConfigError(f"--qsa-context {ctx} is below the shortest record ({least} "
                              "tokens)")
        budget = Budget(**{**asdict(budget), "qsa_context": ctx})
    return base, spec, budget


def _settings(cfg: CompareConfig, budget: Budget) -> dict[str, Any]:
    settings = {"quick": cfg.quick, "tasks": list(cfg.tasks), "seed": cfg.seed,
                "budget": asdict(budget), "baseline_kv": cfg.baseline_kv,
                "decoding": "greedy (temperature 0)"}
    if cfg.qsa is None:  # reports without --qsa keep their earlier shape
        for key in ("qsa_records", "qsa_context"):
            settings["budget"].pop(key)
    else:
        settings["qsa"] = cfg.qsa
    return settings


def run_compare(cfg: CompareConfig) -> tuple[dict[str, Any], dict[str, Path]]:
    """Run the A/B comparison; returns (report dict, written file paths)."""
    t0 = time.time()
    if cfg.qsa is not None and QSA_TASK not in cfg.tasks:
        cfg = replace(cfg, tasks=(*cfg.tasks, QSA_TASK))
    base, spec, budget = _resolve(cfg)
    out = Path(cfg.out)
    for what, d in (("the overlay pack", Path(cfg.overlay)), ("the base checkpoint", base)):
        if lies_within(out.resolve(), d.resolve()):
            # (the control pack and corpus manifest went into it)
            raise ConfigError(f"--out {out} lies inside {what} {d}: give a directory of its "
                              "own")
    # wrong checkpoint (or no pack at all): fail before any write, --out's mkdir included (it
    # ran first and left an empty report directory behind each refused run)
    ab.overlay_fingerprint(base, Path(cfg.overlay))
    make_dirs(out, ConfigError)  # --out under a file: one line, not a mkdir traceback
    control = None if cfg.no_control else (
        cfg.control or ab.make_unit_overlay(base, out / "unit-scale-control"))
    arms = ab.arm_specs(base, Path(cfg.overlay), control, cfg.baseline_kv)
    cal_path = cfg.calibration_manifest or disjoint.find_calibration_manifest(Path(cfg.overlay))
    from kvcap.models.loader import load_tokenizer

    tok = load_tokenizer(base)
    cal_hashes, cal_info = (disjoint.load_calibration_hashes(Path(cal_path), tok)
                            if cal_path else (None, None))
    timings: dict[str, float] = {"validate": time.time() - t0}

    # the KV pool every arm allocates, sized by the tasks that run: the retrieval contexts
    # (FULL: 2 x 8192 tokens) sized it for --tasks heldout too, 32x its 512-token records
    tasks = set(cfg.tasks)
    need = max([budget.record_tokens if tasks & {"heldout", "internals"} else 0,
                512 + budget.max_new_tokens if "generation" in tasks else 0,
                (budget.qsa_context or 0) if QSA_TASK in tasks else 0]
               + [2 * c for c in budget.contexts if "retrieval" in tasks])
    t = time.time()
    llms = ab.build_llms(base, arms, cfg.device, need, qsa=cfg.qsa)
    timings["load_arms"] = time.time() - t
    ref = ab.REFERENCE
    results: dict[str, Any] = {}
    eval_hashes: dict[str, list[str]] = {}
    excluded = 0
    if "heldout" in cfg.tasks or "internals" in cfg.tasks:
        shards = corpora.build_shards(tok, HELDOUT_SHARDS, budget.heldout_tokens, "evaluation",
                                      budget.record_tokens, seed=cfg.seed, progress=False)
        if cal_hashes:
            for s in shards:
                keep = [i for i, h in enumerate(s.hashes()) if h not in cal_hashes]
                excluded += len(s.records) - len(keep)
                s.records = [s.records[i] for i in keep]
                s.provenance = [s.provenance[i] for i in keep]
        corpora.write_manifest(out / "eval-corpus-manifest.json", shards, tok, "evaluation",
                               seed=cfg.seed, record_tokens=budget.record_tokens)
        eval_hashes["heldout"] = [h for s in shards for h in s.hashes()]
        t = time.time()
        results["heldout"], _ = heldout.run_heldout(llms, ref, shards,
                                                    internals="internals" in cfg.tasks)
        timings["heldout"] = time.time() - t
    if "generation" in cfg.tasks:
        prompts = generation.build_prompts(tok, budget.plain_prompts, budget.chat_prompts,
                                           cfg.seed)
        t = time.time()
        results["generation"] = generation.run_generation(llms, ref, prompts,
                                                          budget.max_new_tokens, tok)
        timings["generation"] = time.time() - t
        eval_hashes["generation"] = [p["hash"] for p in results["generation"]["prompts"]]
    if "retrieval" in cfg.tasks:
        cases = retrieval.build_cases(tok, budget.retrieval_tasks, budget.contexts,
                                      budget.depths, cfg.seed)
        t = time.time()
        results["retrieval"] = generation.run_retrieval(llms, ref, cases, tok)
        timings["retrieval"] = time.time() - t
        eval_hashes["retrieval"] = [c["hash"] for c in results["retrieval"]["cases"]]
    if QSA_TASK in cfg.tasks:
        records = qsa_quality.build_records(tok, budget.qsa_context, budget.qsa_records,
                                            cfg.seed, cal_hashes)
        t = time.time()
        results["qsa"] = qsa_quality.run_qsa_quality(llms, ref, records, cfg.qsa,
                                                     source=qsa_quality.SOURCE)
        timings["qsa"] = time.time() - t
        eval_hashes["qsa"] = [corpora.record_hash(r) for r in records]
    device = str(next(iter(llms.values())).device)
    kv_dtypes = {name: llm.kv_dtype for name, llm in llms.items()}
    del llms
    labels = {a.name: a.label.replace("auto KV", f"{kv_dtypes[a.name]} KV")
              + (f", QSA {cfg.qsa}" if cfg.qsa else "") for a in arms}
    plot_names = plots.write_plots(results, labels, out)
    timings["total"] = time.time() - t0
    meta = {
        "environment": report.environment(device),
        "model": {"path": str(base), "spec": asdict(spec), "fingerprint": arms[1].overlay[
            "base_fingerprint"] if arms[1].overlay else None},
        "arms": [{"name": a.name, "label": labels[a.name], "kv_cache_dtype": kv_dtypes[a.name],
                  "overlay": a.overlay} for a in arms],
        "settings": _settings(cfg, budget),
        "data": {"disjointness": disjoint.check(eval_hashes, cal_hashes, cal_info, excluded),
                 "eval_manifest": "eval-corpus-manifest.json" if "heldout" in results else None,
                 "sources": "evaluation split of prose (common-licenses, pydoc topics), "
                            "stdlib code, chat built from them, generated tool calls; "
                            "retrieval cases generated (seeded) with an evaluation-prose haystack"},
        "goals": report.evaluate_goals(results, ab.CALIBRATED,
                                       ab.CONTROL if control is not None else None),
        "timings": timings,
    }
    paths = report.write_report(out, meta, results, plot_names)
    return {**meta, "results": results, "plots": plot_names}, paths
