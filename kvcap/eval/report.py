"""The compare report: goals, self-describing metadata, report.json and report.md."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvcap.eval import report_md
from kvcap.scales.fsutil import atomic_write_text

REPORT_KIND = "kvcap.compare-report"
REPORT_SCHEMA = 1

# (key, description, target text, comparison) for the calibrated arm (issue 4 acceptance).
GOALS: tuple[tuple[str, str, str], ...] = (
    ("first_token_agreement", "first-token agreement (held-out prompts)", ">= 1.0"),
    ("top1_agreement", "teacher-forced top-1 agreement", ">= 0.99"),
    ("kl_mean", "mean KL(ref ‖ arm) [nats]", "<= 0.002"),
    ("ppl_delta_pct", "perplexity delta [%]", "<= 0.5"),
    ("retrieval_regressions", "retrieval paired regressions", "<= 0"),
    ("retrieval_score_delta", "retrieval score minus reference", ">= 0"),
    ("attn_mean_cosine", "mean attention-output cosine (same layer inputs)", ">= 0.999"),
    ("attn_mean_cosine_e2e", "mean attention-output cosine (end to end)", ">= 0.999"),
)


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    from kvcap import __version__ as kvcap_version

    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    else:
        dev = f"{device} ({platform.processor() or platform.machine()}, "
        dev += f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()})"
    return {
        "kvcap": kvcap_version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": dev,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def arm_metrics(results: dict[str, Any], arm: str) -> dict[str, float | None]:
    """The goal quantities of one arm (None where the task did not run)."""
    out: dict[str, float | None] = dict.fromkeys(g[0] for g in GOALS)
    ho = results.get("heldout", {}).get("arms", {}).get(arm)
    if ho:
        out.update(
            top1_agreement=ho.get("top1_agreement"),
            kl_mean=ho.get("kl_mean"),
            ppl_delta_pct=ho.get("ppl_delta_pct"),
        )
        if "internals_isolated" in ho:
            out["attn_mean_cosine"] = ho["internals_isolated"]["mean_cosine"]
        if "internals" in ho:
            out["attn_mean_cosine_e2e"] = ho["internals"]["mean_cosine"]
    gen = results.get("generation", {}).get("arms", {}).get(arm)
    if gen and gen["n"]:
        out["first_token_agreement"] = gen["first_token_equal"] / gen["n"]
    ret = results.get("retrieval", {}).get("arms", {})
    if arm in ret and "regressions" in ret[arm] and ret[arm]["n"]:  # 0 cases: not run
        out["retrieval_regressions"] = len(ret[arm]["regressions"])
        ref = next(v for v in ret.values() if "regressions" not in v)
        out["retrieval_score_delta"] = ret[arm]["score"] - ref["score"]
    return out


def _met(value: float | None, target: str) -> bool | None:
    """None: not measured. NaN is a measurement gone non-finite (e.g. NaN logits from stray
    0x7F bytes): missed, never "not run"."""
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return False
    op, num = target.split()
    return value >= float(num) if op == ">=" else value <= float(num)


def goal_figure(value: Any, target: str) -> str:
    """A goal's value as the tables print it: 4 significant digits, more where 4 would round it
    onto the other side of the target (top-1 0.98996 printed "0.99" beside ">= 0.99 MISSED")."""
    if value is None:
        return "n/a"
    if not isinstance(value, float):
        return str(value)
    text = format(value, ".4g")
    for digits in range(5, 18):
        if _met(float(text), target) == _met(value, target):
            break
        text = format(value, f".{digits}g")
    return text


def evaluate_goals(results: dict[str, Any], arm: str, control: str | None) -> list[dict[str, Any]]:
    ours = arm_metrics(results, arm)
    ctl = arm_metrics(results, control) if control else {}
    return [
        {
            "goal": key,
            "description": desc,
            "target": target,
            "value": ours[key],
            "met": _met(ours[key], target),
            "control_value": ctl.get(key),
        }
        for key, desc, target in GOALS
    ]


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_report(
    out: Path, meta: dict[str, Any], results: dict[str, Any], plots: list[str]
) -> dict[str, Path]:
    """Write report.json and report.md into `out`; returns their paths."""
    report = {
        "kind": REPORT_KIND,
        "schema_version": REPORT_SCHEMA,
        **meta,
        "results": results,
        "plots": plots,
    }
    report = _jsonable(report)
    # Render both before writing either, and write each through a rename, so a failure never
    # leaves a truncated file or a report.md from another run beside report.json.
    # (paths and argv may hold undecodable bytes as lone surrogates: escaped)
    texts = {"json": json.dumps(report, indent=1, ensure_ascii=False) + "\n",
             "md": report_md.render(report)}
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    for key, path in paths.items():
        atomic_write_text(path, texts[key], errors="backslashreplace")
    return paths
