"""The decode and prefill kernels compile for the GPUs kvcap promises to run on, without a GPU:
the exact software E4M3 decoder on pre-FP8 targets (Volta sm_70, Turing sm_75, Ampere sm_80 /
sm_86) must carry no FP8 instruction (ptxas refuses `cvt ... e4m3x2` below sm_89) and, at each
target's own launch configuration, spill no register; Triton has no MMA below sm_80, so V100 and
T4 get FMA dots. The hardware route on Hopper uses the conversion. Runs
scripts/inspect_decode_ptx.py in a subprocess: compiling needs the real inline PTX, which the
CPU interpreter (TRITON_INTERPRET=1 in CI) replaces at import."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvcap.kernels.common import programs_per_sm, target_properties  # noqa: E402
from kvcap.kernels.decode import (  # noqa: E402
    BYTE_ROUTE_D64_REGISTERS,
    BYTE_ROUTE_D64_SHARED_BYTES,
    SIXTEEN_BIT_SHARED_BYTES,
    WORD_ROUTE_64_SHARED_BYTES,
    WORD_ROUTE_D256_REGISTERS,
    WORD_ROUTE_D256_SHARED_BYTES,
    WORD_ROUTE_SHARED_BYTES,
    sixteen_bit_registers,
    word_route_d256_launch,
    word_route_launch,
)
from kvcap.kernels.prefill import PREFILL_E4M3_MAXNREG  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inspect_decode_ptx.py"


def _stages(sm: int) -> int:
    """The word route's pipeline depth on an sm_XY GPU, as decode_config picks it for the
    script's --defaults (word_route_launch of the target's properties)."""
    return word_route_launch(target_properties(sm))[0]


# `python SCRIPT ARGS` for every case, less its ~4 s of importing torch (30 cases: 2 of CI's
# minutes): one Python imports torch and Triton, with the interpreter off as the script has it,
# and runs the script for each case in a fork of itself, a fresh process as before.
_FORK_RUNNER = r"""
import json, os, runpy, sys, traceback
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton  # noqa: F401, E401
for line in sys.stdin:
    script, args, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv, code = [script, *args], 1
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
_runner: subprocess.Popen | None = None


@pytest.fixture(scope="module", autouse=True)
def _stop_runner():
    global _runner
    yield
    if _runner is not None:
        _runner.stdin.close()
        _runner.wait(timeout=60)
        _runner = None


def _counts(*args: str) -> dict[str, int]:
    global _runner
    if _runner is None or _runner.poll() is not None:  # first call, or the runner died
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _runner = subprocess.Popen([sys.executable, "-c", _FORK_RUNNER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        _runner.stdin.write(json.dumps([str(SCRIPT), args, str(out), str(err)]) + "\n")
        _runner.stdin.flush()
        if not select.select([_runner.stdout], [], [], 600)[0]:
            _runner.kill()
            pytest.fail(f"inspect_decode_ptx.py {' '.join(args)}: no result in 600 s")
        code = int(_runner.stdout.readline() or "-1")  # (-1: the runner itself died)
        stdout, stderr = (f.read_text() if f.exists() else "" for f in (out, err))
    assert code == 0, stderr[-3000:]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s+(\S+(?: \S+)*?)\s+(-?\d+)$", stdout,
                                                 re.MULTILINE)}


@pytest.mark.parametrize("sm,head_dim", [(70, 64), (70, 128), (70, 256), (75, 64), (75, 128),
                                         (75, 256), (80, 128), (86, 128), (80, 256), (86, 256)])
def test_software_decoder_compiles_for_pre_fp8_gpus(sm, head_dim):
    """At the launch configuration and route the GPU gets (decode_config / use_words: FMA-dot
    GPUs below sm_80 read bytes in 32-token tiles, 16 at D = 256; sm_80+ at D = 128 take the
    word route with 3 stages, a 128-register cap and byte pairs): no FP8 instruction and no
    register spills."""
    words = sm >= 80 and head_dim in (128, 256)
    c = _counts("--cache", "software", "--sm", str(sm), "--head-dim", str(head_dim),
                "--defaults", *(["--words"] if words else []))
    assert c["cvt.rn.f16x2.e4m3x2"] == 0
    assert c["prmt"] > 0  # the packed decoder's / the byte pairs' permutes are there
    assert (c["mma.sync"] > 0) == (sm >= 80)
    assert c["spill store bytes"] == 0
    if words:  # the residency the split heuristic assumes (decode_config)
        _assert_word_residency(c, sm, head_dim)


def _assert_word_residency(c: dict, sm: int, head_dim: int) -> None:
    """The word route's program fits the shared memory (and, uncapped at D = 256, the
    registers) that decode_config's residency and split count assume."""
    if head_dim == 128:
        assert c["shared memory bytes"] <= WORD_ROUTE_SHARED_BYTES[_stages(sm)]
    else:
        assert c["shared memory bytes"] <= WORD_ROUTE_D256_SHARED_BYTES
        cap = word_route_d256_launch(target_properties(sm))[0]
        assert c["registers"] <= (cap or WORD_ROUTE_D256_REGISTERS)


@pytest.mark.parametrize("sm,dtype", [(80, "bf16"), (90, "bf16"), (90, "fp16")])
def test_fp16_cache_residency_on_mma_gpus(sm, dtype):
    """The 16-bit kernel at D = 128 fits the shared memory and registers its split cap
    assumes (decode_config's `resident`), and the E4M3 word route's three-stage launch for
    wide short calls fits WORD_ROUTE_SHARED_BYTES[3] (spills: 8 bytes with triton 3.6, none
    with 3.9; the measured launch)."""
    c = _counts("--cache", "fp16", "--sm", str(sm), "--defaults", "--dtype", dtype)
    assert c["shared memory bytes"] <= SIXTEEN_BIT_SHARED_BYTES[128]
    assert c["registers"] <= sixteen_bit_registers(target_properties(sm), 128)
    assert c["spill store bytes"] == 0
    if sm == 90:
        c = _counts("--cache", "native", "--words", "--sm", "90", "--block-n", "128",
                    "--num-warps", "4", "--num-stages", "3", "--maxnreg", "128", "--pairs",
                    "--dtype", dtype)
        assert c["shared memory bytes"] <= WORD_ROUTE_SHARED_BYTES[3]
        assert c["spill store bytes"] <= 8


@pytest.mark.parametrize("cache,dtype", [("native", "bf16"), ("software", "bf16"),
                                         ("native", "fp16")])
def test_word_route_64_token_tiles_residency_on_hopper(cache, dtype):
    """The word route's 64-token launch (decode_config where word_route_tile gives 64: 4 warps,
    5 stages, 128-register cap, byte pairs) fits WORD_ROUTE_64_SHARED_BYTES on sm_90 without
    spills, so 4 programs per SM hold as its split rule assumes."""
    c = _counts("--cache", cache, "--words", "--sm", "90", "--block-n", "64", "--num-warps",
                "4", "--num-stages", "5", "--maxnreg", "128", "--pairs", "--dtype", dtype)
    assert c["shared memory bytes"] <= WORD_ROUTE_64_SHARED_BYTES
    assert c["registers"] <= 128
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("sm", [80, 86, 90])
def test_fp16_cache_residency_at_d256(sm):
    """The 16-bit kernel at D = 256 fits the shared memory and registers its split cap
    assumes (sixteen_bit_resident: 3 programs per SM on the H200)."""
    c = _counts("--cache", "fp16", "--sm", str(sm), "--head-dim", "256", "--defaults",
                "--dtype", "bf16")
    assert c["shared memory bytes"] <= SIXTEEN_BIT_SHARED_BYTES[256]
    assert c["registers"] <= sixteen_bit_registers(target_properties(sm), 256)
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("sm", [80, 86, 90])
def test_fp16_cache_residency_at_d64(sm):
    """The 16-bit kernel at D = 64 (the embedded model) fits the shared memory and registers
    its split cap assumes (sixteen_bit_resident: 5 programs per SM on the H200)."""
    c = _counts("--cache", "fp16", "--sm", str(sm), "--head-dim", "64", "--defaults",
                "--dtype", "bf16")
    assert c["shared memory bytes"] <= SIXTEEN_BIT_SHARED_BYTES[64]
    assert c["registers"] <= sixteen_bit_registers(target_properties(sm), 64)
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("sm,cache", [(80, "software"), (86, "software"), (90, "native"),
                                      (90, "software")])
def test_e4m3_byte_route_residency_at_d64(sm, cache):
    """The E4M3 byte route at D = 64 fits the shared memory and registers its launch assumes
    (byte_route_d64_launch: 5 stages, 4 programs per SM on the H200; 2 stages elsewhere)."""
    c = _counts("--cache", cache, "--sm", str(sm), "--head-dim", "64", "--defaults",
                "--dtype", "bf16")
    stages = 5 if sm == 90 else 2
    assert c["shared memory bytes"] <= BYTE_ROUTE_D64_SHARED_BYTES[stages]
    assert c["registers"] <= BYTE_ROUTE_D64_REGISTERS
    assert c["spill store bytes"] == 0


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


@pytest.mark.parametrize("gdc", [1, 2])
def test_dependent_launch_compiles_on_hopper(gdc):
    """The decode kernel as a programmatic dependent (common.pdl_mode's forms): it waits and
    releases its successor, and the wait costs no spills or shared memory."""
    base = ("--cache", "native", "--sm", "90", "--defaults", "--words")
    plain, dep = _counts(*base), _counts(*base, "--gdc", str(gdc))
    assert plain["griddepcontrol.wait"] == plain["griddepcontrol.launch_dependents"] == 0
    assert dep["griddepcontrol.wait"] >= 1 and dep["griddepcontrol.launch_dependents"] >= 1
    assert dep["spill store bytes"] == 0
    assert dep["shared memory bytes"] == plain["shared memory bytes"]


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


@pytest.mark.parametrize("cache,dtype", [("native", "bf16"), ("software", "bf16"),
                                         ("software", "fp16")])
def test_e4m3_prefill_holds_three_programs_per_sm_on_hopper(cache, dtype):
    """E4M3 prefill at D = 128 on sm_90 runs under a register cap (PREFILL_E4M3_MAXNREG):
    uncapped these variants take 175-187 registers (2 programs per SM), capped they must spill
    nothing and fit three programs in an H200 SM's registers and shared memory."""
    c = _counts("--kernel", "prefill", "--cache", cache, "--sm", "90", "--head-dim", "128",
                "--dtype", dtype)
    assert c["spill store bytes"] == 0
    assert c["registers"] <= PREFILL_E4M3_MAXNREG
    assert programs_per_sm(target_properties(90), c["shared memory bytes"], c["registers"],
                           4) >= 3


@pytest.mark.parametrize("cache,sm,head_dim", [("software", 80, 128), ("software", 86, 256),
                                               ("native", 90, 128), ("software", 90, 128)])
def test_bf16_queries_compile_to_fp16_dots(cache, sm, head_dim):
    """BF16 queries over an E4M3 cache at the GPU's defaults run FP16 dots: no decoded value
    is converted on its way to a dot (BF16 dots cost one cvt.rn.bf16.f16 per element on
    sm_90, and cvt.f32.f16 + cvt.rn.bf16.f32 per element below it: 256 / 512 per thread and
    128-token tile at D = 128), and the word route keeps the shared memory its residency
    assumes. Spills: none with the H200's triton 3.6; with triton 3.9 up to two registers
    stored before the word route's tile loop since its unsigned word offsets
    (common.paged_word_offsets, 2026-12-04: on the H200, 109 instructions fewer per tile and
    1-3% / 4-5% faster natively / in software; the loop's local loads and stores went from 12 / 1
    to 13 / 2 at sm_90) and one at sm_86's D = 256 word route (none in its loop)."""
    words = head_dim in (128, 256)
    c = _counts("--cache", cache, "--sm", str(sm), "--head-dim", str(head_dim), "--defaults",
                "--dtype", "bf16", *(["--words"] if words else []))
    assert c["cvt.f32.f16"] == 0 and c["cvt.rn.bf16.f16"] == 0
    assert (c["cvt.rn.f16x2.e4m3x2"] > 0) == (cache == "native")
    assert c["spill store bytes"] <= {(90, 128): 8, (86, 256): 4}.get((sm, head_dim), 0)
    if words:
        _assert_word_residency(c, sm, head_dim)


@pytest.mark.parametrize("cache,sm", [("software", 80), ("software", 86), ("native", 90),
                                      ("software", 90)])
def test_short_byte_route_compiles_without_spills(cache, sm):
    """The short-context byte route at D = 128 (64-token tiles, 2 stages, uncapped; BF16
    queries on FP16 dots) on tensor-core GPUs: no spill, no decoded value converted, the FP8
    instruction only where the hardware decoder runs."""
    c = _counts("--cache", cache, "--sm", str(sm), "--head-dim", "128", "--defaults", "--short",
                "--dtype", "bf16")
    assert c["spill store bytes"] == 0
    assert c["cvt.f32.f16"] == 0 and c["cvt.rn.bf16.f16"] == 0
    assert (c["cvt.rn.f16x2.e4m3x2"] > 0) == (cache == "native")


@pytest.mark.parametrize("cache,dtype", [("native", "fp16"), ("native", "bf16"),
                                         ("software", "bf16")])
def test_d256_word_route_on_hopper(cache, dtype):
    """The E4M3 word route at D = 256 on sm_90 (decode_config: 64-token tiles, 3 stages,
    128-register cap, 4 programs per SM). ptxas spills under the cap: 4-20 bytes with CI's
    triton 3.9, 56-60 with the H200's 3.6 since the unsigned word offsets (ba8cc02; 20 before,
    and 1 STL / 2 LDL per tile against 3 / 7 now) -- measured faster all the same, 0.96-1.00x
    natively and 0.94-0.99x in software at 8-64 sequences x 16K / 32K (docs/kernels.md,
    "Twenty-ninth change"); the launch itself took 0.76-0.91x the byte route's time. A spill
    up to what was measured is accepted here and anything more fails
    (decode.WORD_ROUTE_D256_SHARED_BYTES)."""
    c = _counts("--cache", cache, "--sm", "90", "--head-dim", "256", "--defaults", "--words",
                "--dtype", dtype)
    assert (c["cvt.rn.f16x2.e4m3x2"] > 0) == (cache == "native")
    assert c["spill store bytes"] <= 60
    _assert_word_residency(c, 90, 256)
    assert programs_per_sm(target_properties(90), c["shared memory bytes"], c["registers"],
                           4) == word_route_d256_launch(target_properties(90))[1] == 4


def test_sass_defaults_reports_each_launch(tmp_path, monkeypatch):
    """scripts/sass_defaults.py (the table to read before spending device time): one route
    compiled for sm_90, its row printed and written with the Triton version and provenance."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import sass_defaults
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(sass_defaults, "ROUTES", [("E4M3 bytes", 64, ["native"], [])])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiler, not the interpreter
    out = tmp_path / "sass.json"
    assert sass_defaults.main(["--sm", "90", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["sm"] == 90 and report["triton"] and "source_digest" in report
    assert row["route"] == "E4M3 bytes" and row["head_dim"] == 64
    assert row["registers"] > 0 and row["sass loop instructions"] > 0
    assert row["spill store bytes"] == 0


@pytest.mark.parametrize("cache,words", [("native", True), ("fp16", False)])
def test_prewait_prefetch_runs_ahead_of_the_dependent_launch_wait(tmp_path, cache, words):
    """paged_decode(prewait=True) on sm_90 with dependent launches: the first tile's L2
    prefetches (one per K / V row a thread owns) sit before `griddepcontrol.wait` in the PTX,
    after the sequence-length and block-table loads they need; without prewait there are
    none."""
    args = ["--cache", cache, "--sm", "90", "--head-dim", "128", "--defaults", "--dtype", "bf16",
            "--gdc", "2"] + (["--words"] if words else [])
    assert _counts(*args)["prefetch.global.L2"] == 0
    c = _counts(*args, "--prewait", "--dump", str(tmp_path))
    assert c["prefetch.global.L2"] > 0 and c["griddepcontrol.wait"] == 1
    assert c["spill store bytes"] <= {True: 8}.get(words, 0)  # the word route's own bound
    ptx = (tmp_path / "decode.ptx").read_text()
    wait = ptx.index("griddepcontrol.wait")
    prefetches = [m.start() for m in re.finditer(r"prefetch\.global\.L2", ptx)]
    assert prefetches and max(prefetches) < wait
    assert ptx.index("ld.global") < min(prefetches)


@pytest.mark.parametrize("kernel,cache,sm,head_dim,words", [
    ("decode", "software", 80, 128, True), ("decode", "native", 90, 128, True),
    ("decode", "fp16", 90, 64, False), ("decode", "software", 75, 128, False),
    ("prefill", "native", 90, 128, False), ("prefill", "software", 80, 64, False)])
def test_sliding_window_launches_compile_like_the_full_ones(kernel, cache, sm, head_dim, words):
    """A sliding window (WINDOW, a constexpr) adds a few compares to the first tile's masks:
    at each GPU's default launch it spills nothing and fits the shared memory and registers
    the full-context launch takes (the residency the split heuristic assumes)."""
    args = ["--kernel", kernel, "--cache", cache, "--sm", str(sm), "--head-dim", str(head_dim),
            *(["--defaults"] if kernel == "decode" else []), *(["--words"] if words else [])]
    full, windowed = _counts(*args), _counts(*args, "--window", "4096")
    assert windowed["spill store bytes"] == 0

    def resident(c: dict) -> int:  # every one of these launches runs 4 warps
        return programs_per_sm(target_properties(sm), c["shared memory bytes"], c["registers"], 4)
    assert resident(windowed) == resident(full)


@pytest.mark.parametrize("sm,rows,k_group", [(70, 16, 0), (75, 64, 128), (80, 16, 128),
                                             (86, 256, 0), (89, 16, 128), (90, 16, 0),
                                             (90, 64, 128), (90, 256, 128)])
def test_fp8_weight_gemm_compiles_for_every_gpu(sm, rows, k_group):
    """The FP8-weight GEMM (kernels/fp8_gemm.py) at launch_config's launch for each target, on
    the 8B down_proj (4096 x 14336): the hardware conversion from sm_89, the packed software
    decoder below it and no FP8 instruction there, MMA from sm_80 (wgmma for Hopper's 64-row
    tiles), and no register spills."""
    software = sm < 89
    c = _counts("--kernel", "fp8_gemm", "--sm", str(sm), "--rows", str(rows), "--n", "4096",
                "--k", "14336", "--k-group", str(k_group), "--cache",
                "software" if software else "native", "--dtype", "bf16" if sm >= 80 else "fp16")
    assert (c["cvt.rn.f16x2.e4m3x2"] > 0) == (not software)
    # the packed decoder permutes bytes (so does the swapped launch's register operand layout)
    assert c["prmt"] > 0 or not software
    assert (c["mma.sync"] + c["wgmma"] > 0) == (sm >= 80)
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("rows,n,k,k_group,swiglu", [
    (64, 6144, 4096, 0, False), (128, 4096, 14336, 128, False), (256, 28672, 4096, 0, False),
    (256, 6144, 4096, 128, False), (256, 28672, 4096, 128, False), (256, 14336, 4096, 0, True),
    (128, 14336, 4096, 128, True), (256, 14336, 4096, 128, True)])
def test_fp8_weight_gemm_swapped_operands_on_hopper(rows, n, k, k_group, swiglu):
    """Above 32 rows on sm_90 launch_config swaps the operands (where 128-row tiles would leave
    SMs idle, and always above 64 rows): every warpgroup MMA takes the decoded weight tile
    from registers -- no shared-memory round trip -- and the launch does not spill; so do
    the launches that scale 128 x 128 blocks on the decoded tile (QKV and gate/up at 256
    rows: 64 and 128 weight rows a program; the fused SwiGLU above 64 rows: 128 of gate and
    of up)."""
    c = _counts("--kernel", "fp8_gemm", "--sm", "90", "--rows", str(rows), "--n", str(n),
                "--k", str(k), "--k-group", str(k_group), "--dtype", "bf16",
                *(["--swiglu"] if swiglu else []))
    assert c["wgmma"] > 0 and c["wgmma register A"] > 0 and c["mma.sync"] == 0
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("rows,gdc", [(16, 1), (16, 2), (64, 1)])
def test_fp8_weight_gemm_dependent_launch_compiles_on_hopper(rows, gdc):
    """At decode rows on sm_90 the FP8-weight GEMM launches as a programmatic dependent like
    the other decode kernels: one wait, one release, in both release forms, no spills; and at
    64 rows, the swapped launch, where the SXM H100 launches it as a dependent too."""
    c = _counts("--kernel", "fp8_gemm", "--sm", "90", "--rows", str(rows), "--n", "6144", "--k",
                "4096", "--dtype", "bf16", "--gdc", str(gdc))
    assert c["griddepcontrol.wait"] == 1 and c["griddepcontrol.launch_dependents"] == 1
    assert c["spill store bytes"] == 0


@pytest.mark.parametrize("sm,k_group", [(80, 0), (90, 0), (90, 128)])
def test_fp8_weight_gemm_split_k_keeps_its_pipeline(sm, k_group):
    """Split K (an o_proj-shaped 4096 x 4096 at 16 rows, 2 splits): the reduction adds one
    arrival atomic and no spills, and the K loop stays software-pipelined -- the same shared
    memory (stages of cp.async buffers) as the unsplit launch. Each program's K range starts
    at program_id * k_split, which the JIT marks 16-divisible as it is; without that the loads
    could not be proven aligned and would not be pipelined."""
    args = ["--kernel", "fp8_gemm", "--sm", str(sm), "--rows", "16", "--n", "4096", "--k",
            "4096", "--k-group", str(k_group), "--cache", "native" if sm >= 89 else "software",
            "--dtype", "bf16"]
    whole, split = _counts(*args), _counts(*args, "--split-k", "2")
    assert whole["atom.global"] == 0 and split["atom.global"] == 1
    assert split["shared memory bytes"] == whole["shared memory bytes"] > 0
    assert split["spill store bytes"] == 0
