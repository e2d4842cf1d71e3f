"""Every kernel launch in kvcap/kernels states its FP fusion (FMA contraction): Triton turned
it on by default up to 3.9 and turns it off from 3.10, and kvcap's kernels were measured and
tested with a definite setting -- common.FP_FUSION (on) or enable_fp_fusion=False where a kernel
rounds as its torch twin rounds. A launch that leaves it to the installed Triton fails here."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kvcap" / "kernels"
LAUNCH = re.compile(r"\b(_[A-Za-z_0-9]+)\[(?:[^\[\]]|\[[^\]]*\])*\]\(")


def _launches(text: str):
    """(kernel name, argument text) of each `kernel[grid](...)` call in `text`."""
    for m in LAUNCH.finditer(text):
        depth, j = 1, m.end()
        while depth:
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[j], 0)
            j += 1
        yield m.group(1), text[m.end():j - 1]


def test_every_launch_states_fp_fusion():
    found, missing = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        for name, args in _launches(path.read_text()):
            found += 1
            if "FP_FUSION" not in args and "enable_fp_fusion" not in args:
                missing.append(f"{path.name}: {name}")
    assert found >= 20, found  # the scan still sees the launches
    assert not missing, missing


def test_scan_sees_a_launch_without_it():
    src = "out = _k[(n, m)](x, y, BLOCK=4, num_warps=4)\n_j[g](a, **FP_FUSION)\n"
    assert [(n, "FP_FUSION" in a) for n, a in _launches(src)] == [("_k", False), ("_j", True)]
