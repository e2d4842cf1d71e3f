"""kvcap.bench.kernels: verdict and CLI bugs found by a hunt (each test failed before its fix)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before kvcap.kernels is imported (its constexprs read it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcap.bench.kernels as kb  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
H100_TARGETS = BENCH / "kernels-2026-12-05-h100-8b-bf16-targets.json"


def test_never_slower_names_the_cells_at_4k_that_no_file_holds(capsys):
    """E4M3 never slower than the 16-bit kernel is judged over every shape's cells at
    ctx >= 4K; a file with only the nine 8B target cells (the H100 run) left B 1 / 4 and every
    4K cell of the 8B shape unnamed: '0 cells slower' read as met over cells no file holds
    (only wholly absent shapes were named)."""
    assert kb.main(["--summary", str(H100_TARGETS)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("E4M3 slower"))
    assert "missing (no file has it): llama31-8b B=1 ctx=4096" in line
    assert "shapes with no cells: gqa6-d256, smollm2-135m" in line
    # a complete 8B matrix (B 1..64 x 1K..128K, 64 x 128K skipped): nothing of it is missing
    rows = kb.read_result(BENCH / "kernels-2026-12-04d-h200-8b-bf16-matrix.json")["cells"]
    line = kb.target_verdicts(rows)[3]
    assert "missing" not in line and "shapes with no cells: gqa6-d256, smollm2-135m" in line


def _no_gpu_work(monkeypatch):
    """main() past its CUDA check with every GPU step replaced by a failure."""
    def gpu(*a, **k):
        raise AssertionError("GPU work before the --out check")

    monkeypatch.setattr(kb.torch.cuda, "is_available", lambda: True)
    for name in ("run_info", "run_checks", "measure_ceilings"):
        monkeypatch.setattr(kb, name, gpu)


@pytest.mark.parametrize("make", [
    lambda tmp: tmp / "a-file",                 # a directory named by an existing file
    lambda tmp: tmp / "a-file" / "k.json",      # a .json under a file
])
def test_an_out_path_that_cannot_be_created_is_a_usage_error_before_gpu_work(
        tmp_path, monkeypatch, capsys, make):
    """--out was resolved (result_path's mkdir) only after the checks and the read ceiling
    had run on the GPU, and a path under an existing file was then a FileExistsError /
    NotADirectoryError traceback: now one usage line, status 2, before any GPU work."""
    (tmp_path / "a-file").write_text("x")
    _no_gpu_work(monkeypatch)
    out = make(tmp_path)
    with pytest.raises(SystemExit) as e:
        kb.main(["--out", str(out), "--skip-checks"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out:" in err and str(out) in err


@pytest.mark.parametrize("argv", [
    ["--compare-words", "--shapes", "llama31-8b"],
    ["--compare-decoders", "--shapes", "gqa6-d256"],
    ["--sweep-only", "--shapes", "smollm2-135m"],
    ["--compare-fold", "--shapes", "llama31-8b"],
    ["--compare-pairs", "--shapes", "gqa6-d256"],
])
def test_own_cell_modes_refuse_shapes_they_would_ignore(argv, capsys):
    """--shapes was not among the flags own_cells_error checks: `--compare-fold --shapes
    llama31-8b` timed FOLD_CELLS' D256 and D64 cells too (and --compare-words, --compare-decoders,
    --sweep-only and --compare-pairs likewise), the `--batches 8` bug for shapes."""
    with pytest.raises(SystemExit) as e:
        kb.main(argv)
    assert e.value.code == 2
    assert "--shapes" in capsys.readouterr().err


def test_own_cell_modes_that_honour_shapes_still_take_them(monkeypatch):
    """--sweep-occupancy filters its own cells by --shapes, and --grid times --shapes x ...:
    neither is refused."""
    own_cells_error = kb.own_cells_error
    seen = []
    monkeypatch.setattr(kb, "own_cells_error",
                        lambda args: seen.append(args) or "stop here")  # main's parsed args

    def parsed(*argv):
        with pytest.raises(SystemExit):
            kb.main(list(argv))
        return seen[-1]

    assert own_cells_error(parsed("--sweep-occupancy", "--shapes", "llama31-8b")) is None
    assert own_cells_error(parsed("--compare-fold", "--shapes", "llama31-8b", "--grid")) is None
    assert own_cells_error(parsed("--shapes", "llama31-8b")) is None  # the matrix


def test_summary_judges_files_of_different_gpus_apart(capsys):
    """`--summary H200-matrix H100-targets`: the H100 file's cells replaced the H200 run's
    (a cell in two files counts once, the later file's), so the H200's 'met in 1 of 8' read
    'met in 7 of 8' with no cell naming its GPU. Each GPU's files are now judged apart."""
    h200 = BENCH / "kernels-2026-12-04d-h200-8b-bf16-matrix.json"
    assert kb.main(["--summary", str(h200)]) == 0
    alone = [x for x in capsys.readouterr().out.splitlines() if x.startswith("native >=")]
    assert len(alone) == 1 and "met in 1 of 8 cells" in alone[0]
    assert kb.main(["--summary", str(H100_TARGETS)]) == 0
    h100 = [x for x in capsys.readouterr().out.splitlines() if x.startswith("native >=")]
    assert kb.main(["--summary", str(h200), str(H100_TARGETS)]) == 0
    out = capsys.readouterr().out
    both = [x for x in out.splitlines() if x.startswith("native >=")]
    assert both == alone + h100
    assert "== NVIDIA H200 (each GPU's files judged apart)" in out
    assert "== NVIDIA H100 80GB HBM3 (each GPU's files judged apart)" in out


def test_a_file_whose_native_arm_ran_the_software_decoder_is_not_judged_native(tmp_path,
                                                                            capsys):
    """Under KVCAP_FORCE_SOFTWARE_FP8=1 (or before SM89) the "native" arm (fp8_mode auto) runs
    the software decoder: files now say so (run_info's native_arm_decoder), and --summary
    leaves that arm out instead of judging "software within 1.15x of native" on two runs of
    one decoder."""
    import json

    h200 = BENCH / "kernels-2026-12-04d-h200-8b-bf16-matrix.json"
    result = json.loads(h200.read_text())
    result["info"].update(native_arm_decoder="software",
                          switches={"KVCAP_FORCE_SOFTWARE_FP8": "1"})
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps(result))
    assert kb.main(["--summary", str(h200)]) == 0
    honest = capsys.readouterr().out
    assert "met in 1 of 8 cells" in honest and "software decoder" not in honest
    assert kb.main(["--summary", str(forced)]) == 0
    out = capsys.readouterr().out
    assert "native arm ran the software decoder (left out of the verdicts)" in out
    assert "switches KVCAP_FORCE_SOFTWARE_FP8=1" in out
    native = next(x for x in out.splitlines() if x.startswith("native >="))
    assert "met in 0 of" in native or "met in 1 of" not in native


def test_run_info_records_the_native_arms_decoder_and_the_switches(monkeypatch):
    class Props:
        name, multi_processor_count, L2_cache_size = "Test GPU", 4, 2**20

    monkeypatch.setattr(kb.torch.cuda, "get_device_properties", lambda dev: Props)
    monkeypatch.setattr(kb, "use_software_fp8", lambda dev: True)
    monkeypatch.setenv("KVCAP_WORD_ROUTE_TILE", "64")
    monkeypatch.setenv("KVCAP_COMMIT", "abc1234")
    info = kb.run_info()
    assert info["native_arm_decoder"] == "software"
    assert info["switches"]["KVCAP_WORD_ROUTE_TILE"] == "64"
    assert "KVCAP_COMMIT" not in info["switches"]
