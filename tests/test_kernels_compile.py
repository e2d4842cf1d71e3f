"""The decode and prefill kernels compile for the GPUs kvcap promises to run on, without a GPU:
the exact software E4M3 decoder on pre-FP8 targets (Volta sm_70, Turing sm_75, Ampere sm_80 /
sm_86) must carry no FP8 instruction (ptxas refuses `cvt ... e4m3x2` below sm_89) and, at each
target's own launch configuration, spill no register; Triton has no MMA below sm_80, so V100 and
T4 get FMA dots. The hardware route on Hopper uses the conversion. Runs
scripts/inspect_decode_ptx.py in a subprocess: compiling needs the real inline PTX, which the
CPU interpreter (TRITON_INTERPRET=1 in CI) replaces at import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcap.kernels.common import target_properties  # noqa: E402
from kvcap.kernels.decode import WORD_ROUTE_SHARED_BYTES, word_route_launch  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inspect_decode_ptx.py"


def _stages(sm: int) -> int:
    """The word route's pipeline depth on an sm_XY GPU, as decode_config picks it for the
    script's --defaults (word_route_launch of the target's properties)."""
    return word_route_launch(target_properties(sm))[0]


def _counts(*args: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s+(\S+(?: \S+)*?)\s+(-?\d+)$", run.stdout,
                                                 re.MULTILINE)}


@pytest.mark.parametrize("sm,head_dim", [(70, 64), (70, 128), (70, 256), (75, 64), (75, 128),
                                         (75, 256), (80, 128), (86, 128)])
def test_software_decoder_compiles_for_pre_fp8_gpus(sm, head_dim):
    """At the launch configuration and route the GPU gets (decode_config / use_words: FMA-dot
    GPUs below sm_80 read bytes in 32-token tiles, 16 at D = 256; sm_80+ at D = 128 take the
    word route with 3 stages, a 128-register cap and byte pairs): no FP8 instruction and no
    register spills."""
    words = sm >= 80 and head_dim == 128
    c = _counts("--cache", "software", "--sm", str(sm), "--head-dim", str(head_dim),
                "--defaults", *(["--words"] if words else []))
    assert c["cvt.rn.f16x2.e4m3x2"] == 0
    assert c["prmt"] > 0  # the packed decoder's / the byte pairs' permutes are there
    assert (c["mma.sync"] > 0) == (sm >= 80)
    assert c["spill store bytes"] == 0
    if words:  # the residency the split heuristic assumes (decode_config)
        assert c["shared memory bytes"] <= WORD_ROUTE_SHARED_BYTES[_stages(sm)]


@pytest.mark.parametrize("sm", [70, 75])
def test_fp16_cache_compiles_without_spills_on_fma_gpus(sm):
    c = _counts("--cache", "fp16", "--sm", str(sm), "--defaults")
    assert c["spill store bytes"] == 0 and c["mma.sync"] == 0


@pytest.mark.parametrize("words", [False, True])
def test_hardware_conversion_on_hopper(words):
    c = _counts("--cache", "native", "--sm", "90", "--defaults", *(["--words"] if words else []))
    assert c["cvt.rn.f16x2.e4m3x2"] > 0 and c["mma.sync"] > 0
    if words:
        assert c["shared memory bytes"] <= WORD_ROUTE_SHARED_BYTES[_stages(90)]
        assert c["spill store bytes"] == 0


@pytest.mark.parametrize("kernel", ["prefill", "qsa"])
@pytest.mark.parametrize("sm,head_dim", [(70, 128), (70, 256), (75, 64), (75, 128)])
def test_prefill_and_qsa_compile_without_spills_on_fma_gpus(kernel, sm, head_dim):
    """The chunked-prefill and QSA sparse kernels at the tiles GPUs without MMA get
    (prefill_config, sparse_config)."""
    c = _counts("--kernel", kernel, "--cache", "software", "--sm", str(sm), "--head-dim",
                str(head_dim))
    assert c["spill store bytes"] == 0 and c["mma.sync"] == 0


@pytest.mark.parametrize("cache,sm", [("software", 80), ("software", 86), ("fp16", 86),
                                      ("fp16", 90), ("native", 90), ("software", 90)])
def test_prefill_compiles_without_spills_on_mma_gpus(cache, sm):
    """The chunked-prefill default at D = 128 on tensor-core GPUs (64 x 64 tiles, 4 warps)
    spills nothing: 128 x 64 tiles, as fast on the H200 at long contexts, spilled 120-632 bytes
    on sm_80-90 (FP16 caches on sm_80 spill 16 bytes at 64 x 64, left as is)."""
    c = _counts("--kernel", "prefill", "--cache", cache, "--sm", str(sm), "--head-dim", "128")
    assert c["spill store bytes"] == 0  # (sm_90 takes wgmma here, so no mma.sync to count)


@pytest.mark.parametrize("cache,sm,head_dim", [("software", 80, 128), ("software", 86, 256),
                                               ("native", 90, 128), ("software", 90, 128)])
def test_bf16_queries_compile_to_fp16_dots(cache, sm, head_dim):
    """BF16 queries over an E4M3 cache at the GPU's defaults run FP16 dots: no decoded value
    is converted on its way to a dot (BF16 dots cost one cvt.rn.bf16.f16 per element on
    sm_90, and cvt.f32.f16 + cvt.rn.bf16.f32 per element below it: 256 / 512 per thread and
    128-token tile at D = 128), and the word route keeps the shared memory its residency
    assumes. Spills: none, but one register at sm_90's native word route (stored before the
    tile loop, reloaded once outside the steady-state loop)."""
    words = head_dim == 128
    c = _counts("--cache", cache, "--sm", str(sm), "--head-dim", str(head_dim), "--defaults",
                "--dtype", "bf16", *(["--words"] if words else []))
    assert c["cvt.f32.f16"] == 0 and c["cvt.rn.bf16.f16"] == 0
    assert (c["cvt.rn.f16x2.e4m3x2"] > 0) == (cache == "native")
    assert c["spill store bytes"] <= (4 if cache == "native" else 0)
    if words:
        assert c["shared memory bytes"] <= WORD_ROUTE_SHARED_BYTES[_stages(sm)]
