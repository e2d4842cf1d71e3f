"""report.md: the tables a person reads, rendered from the JSON report."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str = ".4g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, fmt)
    return str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return out + [""]


def _header(r: dict[str, Any]) -> list[str]:
    env, model = r["environment"], r["model"]
    lines = ["# kvcap compare report", "",
             f"- created: {env['created']}  ", f"- command: `{env['command']}`  ",
             f"- device: {env['device']}  ",
             f"- versions: kvcap {env['kvcap']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, python {env['python']}  ",
             f"- model: `{model['path']}` ({model['fingerprint']['scheme']} = "
             f"`{model['fingerprint']['sha256']}`)  ",
             f"- settings: {r['settings']}", "", "## Arms", ""]
    rows = []
    for a in r["arms"]:
        ov = a.get("overlay") or {}
        rows.append([a["name"], a["label"], a["kv_cache_dtype"],
                     ov.get("scale_file_sha256", "-"),
                     f"{ov['scale_min']:.4g}..{ov['scale_max']:.4g}" if ov else "-"])
    return lines + _table(["arm", "label", "KV dtype", "overlay scale-file sha256", "scales"],
                          rows)


def _goals(r: dict[str, Any]) -> list[str]:
    from kvcap.eval.report import goal_figure  # (report imports this module)

    rows = [[g["description"], g["target"], goal_figure(g["value"], g["target"]),
             goal_figure(g["control_value"], g["target"]),
             {True: "met", False: "**MISSED**", None: "not run"}[g["met"]]] for g in r["goals"]]
    return ["## Goals (calibrated E4M3 vs reference)", ""] + _table(
        ["goal", "target", "calibrated E4M3", "unit-scale control", "status"], rows)


def _heldout(h: dict[str, Any]) -> list[str]:
    lines = ["## Held-out teacher-forced scoring", "",
             f"{h['records']} records, {h['tokens']} tokens; shards: "
             + ", ".join(f"{k} ({v['records']} rec, {v['tokens']} tok)"
                         for k, v in h["shards"].items()), ""]
    rows = []
    for name, a in h["arms"].items():
        q = a.get("kl_quantiles", {})
        rows.append([name, a.get("top1_agreement"), a.get("kl_mean"), q.get("p99"),
                     a.get("kl_max"), a["perplexity"], a["ppl_delta_pct"]])
    lines += _table(["arm", "top-1 agreement", "mean KL", "p99 KL", "max KL", "perplexity",
                     "ppl delta %"], rows)
    rows = []
    for name, a in h["arms"].items():
        for shard, s in a["per_shard"].items():
            rows.append([name, shard, s.get("top1_agreement"), s.get("kl_mean"),
                         s["perplexity"]])
    lines += ["Per shard:", ""] + _table(["arm", "shard", "top-1", "mean KL", "perplexity"],
                                         rows)
    for key, title in (("internals_isolated", "same layer inputs: each layer fed the "
                        "reference's hidden states, so only its own K/V quantization differs"),
                       ("internals", "end to end: same token ids, errors of earlier layers "
                        "propagate")):
        internals = {n: a[key] for n, a in h["arms"].items() if key in a}
        if not internals:
            continue
        lines += [f"### Attention outputs per layer vs reference ({title})", ""]
        lines += _table(["arm", "mean cosine", "min cosine", "mean rel L2", "max rel L2"],
                        [[n, i["mean_cosine"], i["min_cosine"], i["mean_rel_l2"],
                          i["max_rel_l2"]] for n, i in internals.items()])
        names = list(internals)
        layers = len(next(iter(internals.values()))["per_layer"])
        rows = [[layer] + [internals[n]["per_layer"][layer][k] for n in names
                           for k in ("cosine", "rel_l2", "rmse")] for layer in range(layers)]
        lines += _table(["layer"] + [f"{n} {k}" for n in names for k in ("cos", "relL2", "RMSE")],
                        rows)
    return lines


def _generation(g: dict[str, Any]) -> list[str]:
    lines = [f"## Greedy generation ({len(g['prompts'])} held-out prompts x up to "
             f"{g['max_new_tokens']} new tokens)", ""]
    rows = []
    for name, a in g["arms"].items():
        kinds = "; ".join(f"{k}: {v['first_token_equal']}/{v['n']} first, {v['identical']}/"
                          f"{v['n']} identical" for k, v in a["by_kind"].items())
        rows.append([name, f"{a['first_token_equal']}/{a['n']}", f"{a['identical']}/{a['n']}",
                     a["first_divergences"] or "-", a["mean_unigram_jaccard"], kinds])
    lines += _table(["arm", "first token equal", "identical", "first divergence at",
                     "mean token Jaccard", "by kind"], rows)
    for name, a in g["arms"].items():
        for ex in a["divergence_examples"][:1]:
            lines += [f"Example divergence ({name}, prompt {ex['prompt']}, {ex['kind']}, at "
                      f"token {ex['first_divergence']}):", "", "```",
                      "reference: " + ex["reference"][:400].replace("```", "'''"),
                      f"{name}: " + ex["arm"][:400].replace("```", "'''"), "```", ""]
    return lines


def _retrieval(t: dict[str, Any]) -> list[str]:
    lines = ["## Retrieval", ""]
    cases = t["cases"]
    arms = list(t["arms"])
    rows = [[c["task"], c["context"], f"{c['depth']}%"]
            + ["ok" if t["arms"][a]["correct"][i] else "x" for a in arms]
            for i, c in enumerate(cases)]
    lines += _table(["task", "context", "depth"] + arms, rows)
    for a in arms:
        v = t["arms"][a]
        extra = ""
        if "regressions" in v:
            extra = (f"; paired regressions: {v['regressions'] or 'none'}; improvements: "
                     f"{v['improvements'] or 'none'}")
        lines.append(f"- {a}: {v['score']}/{v['n']}{extra}")
    return lines + [""]


def _qsa(q: dict[str, Any]) -> list[str]:
    from kvcap.eval.qsa_quality import SUMMARY_HEADER, summary_rows

    c = q["config"]
    layers = c["layers"]
    span = f"{layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))
    lines = [f"## QSA quality (preset `{q['preset']}`)", "",
             f"Every arm runs QSA on layers {span} ({len(layers)} layers): top-"
             f"{c['topk_groups']} groups of {c['compress_ratio']} = {c['token_budget']} tokens "
             f"+ the open tail, {c['summary']} summaries, {c['head_reduce']} over query heads, "
             f"{c['path']} path. Teacher-forced: {q['records']} record(s) of {q['context']} "
             f"tokens ({q['source']}) through every arm. Metrics count the "
             f"{q['sparse_rows']} positions with more than {c['topk_groups']} complete groups "
             "(the rows where the indexer chooses); selection rows are (position, KV head) "
             "pairs. Status is judged on the overall (pooled) value.", ""]
    lines += _table(list(SUMMARY_HEADER), summary_rows(q))
    mass = q["dense_mass_recall"]
    lines += [f"Dense-mass recall over all rows (incl. those that select everything): "
              f"{_f(mass['all_rows']['overall'])}.", ""]
    header, rows = ["layer"], {}
    for arm, a in q["arms"].items():
        header += [f"{arm} {k}" for k in ("Jaccard", "recall", "exact", "cos", "relL2")]
        for p in a["per_layer"]:
            rows.setdefault(p["layer"], [p["layer"]]).extend(
                p[k] for k in ("jaccard", "recall", "exact_rows", "cosine", "rel_l2"))
    header.append(f"{mass['arm']} dense-mass recall")
    for layer, row in rows.items():
        row.append(mass["per_layer"].get(str(layer)))
    return lines + ["Per QSA layer:", ""] + _table(header, list(rows.values()))


def _data(r: dict[str, Any]) -> list[str]:
    d = r["data"]
    lines = ["## Data provenance and disjointness", "",
             f"- disjointness: {d['disjointness']['summary']}",
             f"- evaluation corpus manifest: `{d.get('eval_manifest')}`",
             f"- held-out sources: {d.get('sources')}", ""]
    return lines


def render(report: dict[str, Any]) -> str:
    lines = _header(report) + _goals(report)
    res = report["results"]
    if "heldout" in res:
        lines += _heldout(res["heldout"])
    if "generation" in res:
        lines += _generation(res["generation"])
    if "retrieval" in res:
        lines += _retrieval(res["retrieval"])
    if "qsa" in res:
        lines += _qsa(res["qsa"])
    lines += _data(report)
    if report.get("plots"):
        lines += ["## Figures", ""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    lines += ["## Timings (s)", "", ", ".join(f"{k}: {v:.1f}" for k, v in
                                             report.get("timings", {}).items()), ""]
    return "\n".join(lines)
