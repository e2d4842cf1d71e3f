"""The CLI chain on a tiny real-format checkpoint (SmolLM2 tokenizer, random 2-layer weights):
calibrate -> envelope -> overlay -> materialize -> verify -> generate in E4M3, and the refusals
each command must give as one line with a non-zero exit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kvscale_helpers import hash_tree, rewrite_json
from safetensors.torch import load_file, save_file

from kvcap.cli import main
from kvcap.scales.binding import MANIFEST_NAME, SCALE_FILE

CORPORA = ["prose", "code", "chat", "tool_json"]
TOKENS = 3000


def build_tiny(root: Path, tokenizer_dir: Path, nan_layer: int | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if nan_layer is not None:
        with torch.no_grad():
            model.model.layers[nan_layer].self_attn.k_proj.weight[0, 0] = float("nan")
    model.save_pretrained(str(root), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, root / name)
    return root


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("chain")
    base = build_tiny(root / "base", default_model_dir)
    calib = root / "calib"
    rc = main(["calibrate", "--model", str(base), "--out", str(calib), "--corpus", *CORPORA,
               "--max-tokens", str(TOKENS), "--record-tokens", "128"])
    assert rc == 0
    return {"root": root, "base": base, "calib": calib}


def test_calibrate_outputs(chain: dict) -> None:
    calib = chain["calib"]
    for name in ("calibration-report.json", "calibration-report.png", "kv_stats.npz",
                 "calibration-corpus.json", "calibration-prompts.json"):
        assert (calib / name).is_file(), name
    assert not any("staging" in p.name for p in calib.parent.iterdir())
    report = json.loads((calib / "calibration-report.json").read_text())
    corpus = json.loads((calib / "calibration-corpus.json").read_text())
    prompts = json.loads((calib / "calibration-prompts.json").read_text())["shards"]
    assert report["shard_names"] == CORPORA == [s["name"] for s in corpus["shards"]]
    assert report["tokens"] == corpus["total_tokens"] == sum(report["shard_tokens"].values())
    assert TOKENS - 16 * len(CORPORA) <= report["tokens"] <= TOKENS
    for shard in corpus["shards"]:  # the manifest hashes are the frozen prompts' hashes
        hashes = [hashlib.sha256(np.asarray(r, dtype="<i4").tobytes()).hexdigest()
                  for r in prompts[shard["name"]]]
        assert hashes == shard["record_hashes"]
        assert report["shard_tokens"][shard["name"]] == shard["num_tokens"]
    assert len(report["tensors"]) == 4
    for t in report["tensors"]:
        assert t["count"] == report["tokens"] * 2 * 8  # T x Hkv x D
        assert t["saturation_ratio"] == 0.0 and 448 * t["scale"] >= t["max_abs"] > 0
        assert set(t["shards"]) == set(CORPORA)
    assert report["model"]["path"] == str(chain["base"])
    assert report["extra"]["tokens_per_second"] > 0


def test_full_chain_to_e4m3_generation(chain: dict, capsys: pytest.CaptureFixture) -> None:
    from kvcap.llm import LLM
    from kvcap.sampling_params import SamplingParams

    root, base = chain["root"], chain["base"]
    before = hash_tree(base)
    rc, out, _ = cli(capsys, "overlay", "--model", str(base), "--report", str(chain["calib"]),
                     "--out", str(root / "pack"), "--vllm-config")
    assert rc == 0 and (root / "pack" / SCALE_FILE).is_file()
    assert (root / "pack" / "vllm-quantization-config.json").is_file()
    rc, out, _ = cli(capsys, "materialize", "--model", str(base), "--overlay",
                     str(root / "pack"), "--out", str(root / "derived"))
    assert rc == 0
    rc, out, err = cli(capsys, "verify", "--model", str(root / "derived"))
    assert rc == 0, err
    assert "gate passed: loaded 4/4 K/V scales" in out
    report = json.loads((chain["calib"] / "calibration-report.json").read_text())
    want_k = [t["scale"] for t in report["tensors"] if t["tensor"] == "K"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for kwargs in ({"model": str(root / "derived")},
                   {"model": str(base), "kv_scales": str(root / "pack")}):
        llm = LLM(kv_cache_dtype="fp8_e4m3", num_blocks=16, max_model_len=128, **kwargs)
        assert llm.pool.k_scales.tolist() == want_k
        outs = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params, use_tqdm=False)
        assert len(outs[0].token_ids) == 4
    assert hash_tree(base) == before


def test_verify_refuses_base_without_scales(chain: dict, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = cli(capsys, "verify", "--model", str(chain["base"]))
    assert rc == 2 and "gate passed" not in out
    assert err.strip().startswith("error: Loaded 0/4 K/V scales. Missing: model.layers.0.")
    assert len(err.strip().splitlines()) == 1
    assert "kvcap calibrate -> kvcap overlay -> kvcap materialize" in err  # what to do


def test_verify_negative_control(chain: dict, capsys: pytest.CaptureFixture) -> None:
    root, base = chain["root"], chain["base"]
    assert cli(capsys, "overlay", "--model", str(base), "--unit-scale-negative-control",
               "--out", str(root / "nc"))[0] == 0
    rc, out, _ = cli(capsys, "verify", "--model", str(base), "--kv-scales", str(root / "nc"))
    assert rc == 0 and "K 1..1, V 1..1" in out
    assert cli(capsys, "materialize", "--model", str(base), "--overlay", str(root / "nc"),
               "--out", str(root / "nc-derived"))[0] == 0
    rc, out, _ = cli(capsys, "verify", "--model", str(root / "nc-derived"))
    assert rc == 0 and "NEGATIVE CONTROL" in out


@pytest.mark.parametrize("tamper", ["manifest", "scale_file", "index"])
def test_verify_refuses_tampered_derived(chain: dict, capsys: pytest.CaptureFixture,
                                         tmp_path: Path, tamper: str) -> None:
    base = chain["base"]
    pack = tmp_path / "pack"
    assert cli(capsys, "overlay", "--model", str(base), "--report", str(chain["calib"]),
               "--out", str(pack))[0] == 0
    derived = tmp_path / "derived"
    assert cli(capsys, "materialize", "--model", str(base), "--overlay", str(pack),
               "--out", str(derived))[0] == 0
    if tamper == "manifest":
        rewrite_json(derived / MANIFEST_NAME, lambda d: d["tensors"][
            "model.layers.1.self_attn.v_scale"].update(scale=1.0))
    elif tamper == "scale_file":
        t = load_file(str(derived / SCALE_FILE))
        t["model.layers.1.self_attn.v_scale"] = torch.tensor(float("nan"))
        save_file(t, str(derived / SCALE_FILE))
    else:
        rewrite_json(derived / "model.safetensors.index.json",
                     lambda d: d["weight_map"].pop("model.layers.1.self_attn.v_scale"))
    rc, out, err = cli(capsys, "verify", "--model", str(derived))
    assert rc == 2 and "gate passed" not in out and err.startswith("error: ")


def test_overlay_refuses_weights_changed_after_calibration(
        chain: dict, capsys: pytest.CaptureFixture, tmp_path: Path,
        default_model_dir: Path) -> None:
    base = build_tiny(tmp_path / "base", default_model_dir)  # same as chain's base
    rc, _, _ = cli(capsys, "overlay", "--model", str(base), "--report", str(chain["calib"]),
                   "--out", str(tmp_path / "ok"))
    assert rc == 0  # identical bytes: the report binds
    w = load_file(str(base / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] * 1.01
    save_file(w, str(base / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = cli(capsys, "overlay", "--model", str(base), "--report", str(chain["calib"]),
                     "--out", str(tmp_path / "p"))
    assert rc == 2 and "wrong checkpoint revision" in err and not (tmp_path / "p").exists()


def test_envelope_cli(chain: dict, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    other = tmp_path / "calib-code"
    assert cli(capsys, "calibrate", "--model", str(chain["base"]), "--out", str(other),
               "--corpus", "code", "--max-tokens", "600", "--record-tokens", "128")[0] == 0
    out = tmp_path / "env" / "envelope.json"
    rc, stdout, _ = cli(capsys, "envelope", "--reports", str(chain["calib"]), str(other),
                        "--out", str(out))
    assert rc == 0 and out.is_file() and out.with_suffix(".png").is_file()
    env = json.loads(out.read_text())
    a = json.loads((chain["calib"] / "calibration-report.json").read_text())
    b = json.loads((other / "calibration-report.json").read_text())
    for te, ta, tb in zip(env["tensors"], a["tensors"], b["tensors"], strict=True):
        assert te["max_abs"] == max(ta["max_abs"], tb["max_abs"])
    assert cli(capsys, "overlay", "--model", str(chain["base"]), "--report", str(out),
               "--out", str(tmp_path / "pack"))[0] == 0


@pytest.mark.parametrize("field", ["num_layers", "policy"])
def test_envelope_of_a_report_the_figure_cannot_show(field: str, chain: dict,
                                                     capsys: pytest.CaptureFixture,
                                                     tmp_path: Path) -> None:
    """Fields only the figure reads: a report without them was a KeyError traceback."""
    report = tmp_path / "r.json"
    shutil.copy(chain["calib"] / "calibration-report.json", report)
    rewrite_json(report, lambda r: r.pop(field) if field == "num_layers"
                 else r["policy"].pop("formula"))
    rc, _, err = cli(capsys, "envelope", "--reports", str(report), "--out",
                     str(tmp_path / "env.json"))
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "env.json").exists() and not (tmp_path / "env.png").exists()


def test_calibrate_aborts_on_non_finite(default_model_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    base = build_tiny(tmp_path / "nan", default_model_dir, nan_layer=1)
    rc, _, err = cli(capsys, "calibrate", "--model", str(base), "--out", str(tmp_path / "c"),
                     "--corpus", "prose", "--max-tokens", "200", "--record-tokens", "64")
    assert rc == 2 and "layer 1 K" in err and "non-finite" in err
    assert not (tmp_path / "c").exists()
    assert not any("staging" in p.name for p in tmp_path.iterdir())


def test_calibrate_refusals(chain: dict, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    rc, _, err = cli(capsys, "calibrate", "--model", str(chain["base"]), "--out",
                     str(chain["calib"]), "--corpus", "prose", "--max-tokens", "100")
    assert rc == 2 and "already exists" in err
    rc, _, err = cli(capsys, "calibrate", "--model", str(chain["base"]), "--out",
                     str(tmp_path / "x"), "--corpus", "no-such-corpus")
    assert rc == 2 and "unknown corpus" in err
    rc, _, err = cli(capsys, "calibrate", "--model", str(chain["base"]), "--out",
                     str(tmp_path / "x"), "--policy", "mse")
    assert rc == 2 and "unknown scale policy" in err
    # an --out no one can create is refused before the model loads (it failed at the end)
    (tmp_path / "file").write_text("")
    rc, _, err = cli(capsys, "calibrate", "--model", "dummy-never-loaded", "--out",
                     str(tmp_path / "file" / "cal"), "--corpus", "prose")
    assert rc == 2 and "is a file, not a directory" in err


def test_calibrate_refuses_records_longer_than_the_context(chain: dict, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """The tiny model holds 1024 positions: 2000-token records were refused only as `prompt 1:
    ... does not fit the context`, after the corpora were built, naming no flag."""
    rc, _, err = cli(capsys, "calibrate", "--model", str(chain["base"]), "--out",
                     str(tmp_path / "c"), "--corpus", "prose", "--max-tokens", "4000",
                     "--record-tokens", "2000")
    assert rc == 2 and "--record-tokens 2000" in err and "1023 or less" in err, err
    assert not (tmp_path / "c").exists()


def test_observer_sees_post_rope_k_and_v(chain: dict) -> None:
    """The engine feeds the observer exactly the cache-write tensors: post-RoPE K and V, as
    recomputed here with transformers' own modules (max_abs per layer within FP32 noise)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvcap.llm import LLM
    from kvcap.sampling_params import SamplingParams
    from kvcap.scales.observer import KVStatsObserver

    prompts = [[1, 5, 9, 200, 3000, 47, 8, 8, 12, 40000, 7], [1, 17, 23, 99]]
    llm = LLM(model=str(chain["base"]), enable_prefix_caching=False, num_blocks=8,
              max_model_len=64, dtype="float32")
    obs = KVStatsObserver(2)
    llm.set_kv_observer(obs)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    got = obs.stats().total()
    hf = LlamaForCausalLM.from_pretrained(str(chain["base"]), dtype=torch.float32).eval()
    want = np.zeros((2, 2))
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf(x, output_hidden_states=True)
            pos = torch.arange(len(ids))[None]
            cos, sin = hf.model.rotary_emb(out.hidden_states[0], pos)
            for layer, block in enumerate(hf.model.layers):
                h = block.input_layernorm(out.hidden_states[layer])
                k = block.self_attn.k_proj(h).view(1, len(ids), 2, 8).transpose(1, 2)
                v = block.self_attn.v_proj(h)
                _, k = apply_rotary_pos_emb(k, k, cos, sin)
                want[layer, 0] = max(want[layer, 0], float(k.abs().max()))
                want[layer, 1] = max(want[layer, 1], float(v.abs().max()))
    assert got.rows.tolist() == [15, 15]
    assert got.count.tolist() == [[15 * 16] * 2] * 2
    np.testing.assert_allclose(got.max_abs, want, rtol=1e-4)
