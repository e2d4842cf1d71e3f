"""The throughput cell: a cold prefill phase, then a lockstep decode phase whose prompts hit
the prefix cache (so the decode rate is measured with every request decoding)."""

from __future__ import annotations

import pytest

from kvcap.bench import step_overhead
from kvcap.bench.throughput import run_cell


@pytest.mark.parametrize("long_warmup", [True, False])
def test_run_cell_decodes_in_lockstep_after_a_prefix_hit(long_warmup):
    llm = step_overhead.build_llm(step_overhead.tiny_config_path(), "cpu", 4, 256, 16, "auto",
                                  False)
    steps, cached = [], {}
    orig_step, orig_alloc = llm.engine.step, llm.block_manager.allocate_prompt

    def counting_step():
        outs = orig_step()
        steps.append(len(outs))
        return outs

    def recording_alloc(req, *a, **kw):
        ok = orig_alloc(req, *a, **kw)
        cached[req.request_id] = req.num_cached_prefix_tokens
        return ok

    llm.engine.step = counting_step
    llm.block_manager.allocate_prompt = recording_alloc
    cell = run_cell(llm, concurrency=4, context=80, out_tokens=6, repeats=1,
                    long_warmup=long_warmup)
    assert cell["decode_steps"] == 5
    assert cell["repeats"]["ttft_s"] == [round(cell["ttft_s"], 4)]
    # the warm-up's full-length request (74 prompt tokens), unless left out
    assert ("wlong-0" in cached) == long_warmup
    assert cell["decode_tok_s"] > 0 and cell["prefill_tok_s"] > 0 and cell["ttft_s"] > 0
    # end to end: TTFT, then the 5 remaining tokens' steps at the measured step time
    assert cell["e2e_s"] == pytest.approx(cell["ttft_s"] + 5 * 4 / cell["decode_tok_s"])
    assert cell["repeats"]["e2e_s"] == [round(cell["e2e_s"], 4)]
    # no GPU: no clock or power readings, recorded as None rather than failing
    assert cell["sm_mhz"] is None and cell["power_w_max"] is None
    assert cell["repeats"]["sm_mhz"] == [None]
    # The decode phase reuses the cold phase's 4 full blocks (64 of 74 prompt tokens) ...
    assert {r: c for r, c in cached.items() if r.startswith("d")} == {
        f"d{rep}-{i}": 64 for rep in range(2) for i in range(4)}
    assert all(c == 0 for r, c in cached.items() if r.startswith("p"))
    # ... and then all four requests produce a token in each of its 6 steps.
    assert steps[-6:] == [4] * 6, steps


def test_merge_passes_takes_medians_over_every_pass():
    from kvcap.bench.throughput import merge_passes

    def run(ttft, tok):
        return {"ttft_s": ttft[0], "prefill_tok_s": 1.0, "decode_tok_s": tok[0],
                "decode_steps": 7, "repeats": {"ttft_s": ttft, "decode_tok_s": tok,
                                               "prefill_tok_s": [1.0] * len(tok)}}

    one = run([0.5, 0.7], [100.0, 110.0])
    assert merge_passes([one]) is one
    merged = merge_passes([one, run([0.6, 0.9], [90.0, 130.0])])
    assert merged["repeats"]["decode_tok_s"] == [100.0, 110.0, 90.0, 130.0]
    assert merged["decode_tok_s"] == 105.0 and abs(merged["ttft_s"] - 0.65) < 1e-12
    assert merged["passes"] == 2 and merged["decode_steps"] == 7


def test_gpu_sampler_reads_every_nth_step_and_summarises():
    from kvcap.bench.telemetry import Sampler

    clocks = iter([1980, 1500, 1700])
    sampler = Sampler(every=2, clock=lambda: next(clocks), power=lambda: 650.0)
    for _ in range(5):  # reads at calls 0, 2, 4
        sampler.sample()
    assert sampler.summary() == {"sm_mhz": 1700, "sm_mhz_min": 1500, "power_w": 650.0,
                                 "power_w_max": 650.0}
    blind = Sampler(clock=lambda: None, power=lambda: None)
    blind.sample()
    assert set(blind.summary().values()) == {None}


def test_embedded_model_scales_come_from_the_calibration_corpora(default_model_dir):
    """The throughput benchmark's E4M3 arms of a real checkpoint pass the gate with scales
    calibrated in the run: one positive finite scale per layer and K/V, each the ceiling of
    max_abs / 448 over the corpora's calibration records (here a short prefill)."""
    import math

    from kvcap import LLM
    from kvcap.bench.throughput import calibrated_scales

    scales = calibrated_scales("default", "float32", tokens=2048)
    assert len(scales) == 60  # 30 layers x K/V
    assert all(math.isfinite(v) and v > 0 for v in scales.values())
    llm = LLM(model="default", dtype="float32", kv_cache_dtype="fp8_e4m3", kv_scales=scales,
              max_model_len=256, max_num_seqs=2)
    assert llm.kv_dtype == "fp8_e4m3"


def test_hf_baseline_runs_the_embedded_checkpoint_itself(default_model_dir):
    """The HF `generate` baseline of the embedded model loads the checkpoint (its converted
    HF-format directory), not random weights, and reports positive rates."""
    from kvcap.bench.throughput import hf_baseline

    r = hf_baseline("default", 1, 24, 4, device="cpu")
    assert (r["batch"], r["context"], r["out_tokens"]) == (1, 24, 4)
    assert r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["e2e_s"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--context", "4096", "--max-model-len", "1000"], "--max-model-len 1000 is shorter"),
    (["--context", "1024", "--block-size", "24"], "--block-size must be a power of two"),
    (["--context", "256", "4096"], "--context 256 leaves no prompt"),
    (["--context", "64", "--out-tokens", "64"], "--context 64 leaves no prompt"),
    (["--hf-only", "--out-tokens", "1024"], "--out-tokens 1024 leaves the HF baseline"),
    (["--kv", "fp8", "fp16", "fp8"], "--kv names fp8 more than once"),
    (["--concurrency", "16", "16"], "--concurrency names 16 more than once")])
def test_bad_arguments_are_refused_before_the_gpu_is_needed(capsys, argv, message):
    """A maximum length under the longest context (its cells could not run), a block size
    the kernels do not take and a context or HF baseline with no room for a prompt before
    the output tokens (after the ceiling and the calibration: an empty prompt deep in the
    engine, or HF generate on none) and a list flag naming a value twice (its cells ran
    again) are usage errors on any machine, before any model is built."""
    from kvcap.bench.throughput import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_result_path_takes_a_json_file_or_a_directory_and_never_overwrites(tmp_path):
    """--out: a .json path is used as given (its directory made); a directory gets
    throughput-DATE.json, then -2, -3 ... so a second run on one day keeps the first."""
    from kvcap.bench.provenance import result_path

    named = result_path(tmp_path / "sub" / "run.json", "throughput-2026-12-04")
    assert named == tmp_path / "sub" / "run.json" and named.parent.is_dir()
    first = result_path(tmp_path / "d", "throughput-2026-12-04")
    assert first == tmp_path / "d" / "throughput-2026-12-04.json"
    first.write_text("{}")
    second = result_path(tmp_path / "d", "throughput-2026-12-04")
    assert second == tmp_path / "d" / "throughput-2026-12-04-2.json"
    second.write_text("{}")
    assert result_path(tmp_path / "d", "throughput-2026-12-04").name == \
        "throughput-2026-12-04-3.json"


def test_roofline_counts_only_the_kv_a_sliding_layer_reads():
    """A decode step of a sliding layer reads at most its window: the per-sequence KV tokens
    are averaged over the layers (two of four slide over 1,000 tokens here)."""
    from kvcap.bench.throughput import kv_read_tokens
    from kvcap.kv_cache.spec import KVCacheSpec

    full = KVCacheSpec(4, 2, 64, 16, "fp16")
    mixed = KVCacheSpec(4, 2, 64, 16, "fp16", layer_windows=(1000, None, 1000, None))
    assert kv_read_tokens(full, 4096) == 4096
    assert kv_read_tokens(mixed, 4096) == (1000 + 4096) / 2
    assert kv_read_tokens(mixed, 600) == 600


def test_startup_seconds_name_each_capture(tmp_path):
    """The startup record: LLM(...) in all, and None for captures a CPU engine never makes."""
    import json
    import time

    from kvcap import LLM
    from kvcap.bench.throughput import startup_seconds

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    started = time.perf_counter()
    got = startup_seconds(LLM(model=f"dummy:{tmp_path}", device="cpu", num_blocks=8), started)
    assert isinstance(got["startup_s"], float) and got["startup_s"] >= 0
    assert got["decode_graphs_capture_s"] is None and got["piecewise_graphs_capture_s"] is None
