"""Tiny random-weight Llama / Mistral / Qwen2 / Qwen3 built and saved by transformers itself:
kvcap's teacher-forced logits must match transformers' within 1e-4 (FP32)."""

from __future__ import annotations

import pytest
import torch

from kvcap import LLM
from kvcap.errors import ModelLoadError

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # (its defaults: 32000 ...)


def _build(kind: str):
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(**COMMON, rope_theta=10000.0)
        return tf.LlamaForCausalLM(cfg)
    if kind == "llama3_rope":
        cfg = tf.LlamaConfig(**COMMON, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return tf.LlamaForCausalLM(cfg)
    if kind == "qwen2_yarn":  # transformers' defaults: beta 32 / 1, truncated, 0.1 ln(f) + 1
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    if kind == "llama_yarn":  # every knob set
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, rope_scaling={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.5,
            "mscale_all_dim": 0.5}))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=None))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON))
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=24))
    if kind == "phi3":  # q/k/v and gate/up stored fused
        return tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, **PHI3_IDS))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2_yarn", "llama_yarn", "mistral",
                                  "qwen2", "qwen3", "phi3"])
def test_logits_match_transformers(kind, tmp_path):
    torch.manual_seed(0)
    hf = _build(kind).float().eval()
    with torch.no_grad():  # non-trivial norms and biases so a missed weight shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 150), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    llm = LLM.__new__(LLM)  # tiny models ship no tokenizer: build the engine without one
    _init_without_tokenizer(llm, tmp_path)
    ours = llm.prompt_logits([ids[0].tolist()])[0]
    assert (ours - ref).abs().max().item() < 1e-4


def _init_without_tokenizer(llm: LLM, path, **kw) -> None:
    """LLM.__init__ on a checkpoint that ships no tokenizer (FP32 on CPU, 64 blocks, 64-token
    steps unless `kw` says otherwise)."""
    from kvcap.models import loader

    real = loader.load_tokenizer
    loader.load_tokenizer = lambda _dir: None
    try:
        LLM.__init__(llm, **{"model": str(path), "device": "cpu", "dtype": "float32",
                             "max_num_batched_tokens": 64, "num_blocks": 64, **kw})
    finally:
        loader.load_tokenizer = real


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(Exception, match="unsupported architecture"):
        LLM(model=str(tmp_path), device="cpu")


def test_missing_model_path_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), device="cpu")


def test_shape_mismatch_is_refused(tmp_path):
    import json

    hf = _build("llama")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM.__new__(LLM)
    with pytest.raises(ModelLoadError, match="shape mismatch"):
        _init_without_tokenizer(llm, tmp_path)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_layer_ops_match_transformers(kind, tmp_path, monkeypatch):
    """The fused CUDA path of the decoder layer (add+RMSNorm, RoPE split, SiLU-mul), run
    through the Triton interpreter on CPU, gives transformers' logits too."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set before triton is imported) or a GPU run")
    from kvcap.kernels import fused_ops
    from kvcap.models import llama

    monkeypatch.setattr(llama, "fused_ops_for", lambda x: fused_ops)
    test_logits_match_transformers(kind, tmp_path)


def _mini(arch: str, **extra) -> dict:
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
    return {"architectures": [names[arch]], **COMMON, **extra}


@pytest.mark.parametrize("arch, extra, window, layers", [
    ("mistral", dict(sliding_window=128), 128, (0, 1)),
    ("mistral", dict(sliding_window=256), None, ()),  # a window no sequence outgrows: none
    ("mistral", dict(sliding_window=None), None, ()),
    # no key: transformers' Mistral default, 4096, which a 256-position model never outgrows
    ("mistral", dict(), None, ()),
    ("mistral", dict(max_position_embeddings=8192), 4096, (0, 1)),
    # transformers' Mistral ignores layer_types: every layer slides
    ("mistral", dict(sliding_window=64, layer_types=["full_attention"] * 2), 64, (0, 1)),
    ("llama", dict(sliding_window=4096), None, ()),  # not a Llama field: transformers ignores it
    ("phi3", dict(sliding_window=2047, max_position_embeddings=4096), 2047, (0, 1)),  # Phi-3-mini's
    ("phi3", dict(sliding_window=None), None, ()),  # Phi-4's
    ("qwen2", dict(sliding_window=4096, use_sliding_window=False), None, ()),
    ("qwen2", dict(sliding_window=4096, use_sliding_window=True, max_window_layers=2), None, ()),
    ("qwen2", dict(sliding_window=128, use_sliding_window=True, max_window_layers=1), 128,
     (1,)),
    ("qwen2", dict(sliding_window=128, use_sliding_window=True), None, ()),  # from layer 28
    ("qwen3", dict(sliding_window=64, use_sliding_window=True,
                   layer_types=["sliding_attention", "full_attention"]), 64, (0,)),
    ("qwen3", dict(sliding_window=64, use_sliding_window=True,
                   layer_types=["full_attention", "full_attention"]), None, ()),
])
def test_sliding_window_read_as_transformers_reads_it(arch, extra, window, layers):
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config(_mini(arch, **extra))
    assert (spec.sliding_window, spec.sliding_layers) == (window, layers)
    assert [spec.layer_window(i) for i in range(2)] == [window if i in layers else None
                                                        for i in range(2)]


def test_unsupported_activation_and_bad_window_are_refused():
    from kvcap.config import ModelSpec
    from kvcap.errors import ConfigError

    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        ModelSpec.from_hf_config(_mini("llama", hidden_act="gelu"))
    for key in ("attention_bias", "mlp_bias"):
        with pytest.raises(ConfigError, match=f"{key}: true"):
            ModelSpec.from_hf_config(_mini("llama", **{key: True}))
    with pytest.raises(ConfigError, match="sliding_window 0"):
        ModelSpec.from_hf_config(_mini("mistral", sliding_window=0))


@pytest.mark.parametrize("kind, backend", [("mistral", "torch"), ("qwen3_mixed", "torch"),
                                           ("phi3", "torch"), ("mistral", "triton"),
                                           ("qwen3_mixed", "triton")])
def test_sliding_window_model_matches_transformers_past_its_window(kind, backend, tmp_path,
                                                                   caplog):
    """A 24-token window over 150-token sequences: every layer of a Mistral, or one of a
    Qwen3's two (layer_types), sees only its window. Teacher-forced logits over a prompt
    prefilled in 64-token chunks, and greedy decoding past the window, equal transformers',
    with the torch backend and the Triton kernels (the CPU interpreter here)."""
    import os

    import transformers as tf

    from kvcap import SamplingParams

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set before triton is imported) or a GPU run")
    torch.manual_seed(0)
    if kind == "mistral":
        hf = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=24))
    elif kind == "phi3":
        hf = tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, **PHI3_IDS, sliding_window=24))
    else:
        hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(
            **COMMON, head_dim=32, sliding_window=24, use_sliding_window=True,
            layer_types=["full_attention", "sliding_attention"]))
    hf = hf.float().eval()
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 150), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits[0]
        hf_out = hf.generate(ids[:, :40], max_new_tokens=30, do_sample=False)[0, 40:].tolist()
    llm = LLM.__new__(LLM)
    with caplog.at_level("INFO", logger="kvcap.llm"):
        _init_without_tokenizer(llm, tmp_path, attention_backend=backend)
    assert llm.max_model_len == COMMON["max_position_embeddings"]
    assert "attend to the last 24 tokens" in caplog.text
    ours = llm.prompt_logits([ids[0].tolist()])[0]
    assert (ours - ref).abs().max().item() < 1e-4
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids[0, :40].tolist()], params, use_tqdm=False)[0]
    assert out.token_ids == hf_out


@pytest.mark.parametrize("backend, overlap, drafts", [("torch", False, 0), ("torch", True, 0),
                                                     ("torch", False, 3), ("triton", False, 0)])
def test_sliding_window_releases_blocks_so_long_sequences_fit_a_small_pool(backend, overlap,
                                                                           drafts, tmp_path):
    """Every layer of a Mistral slides over 24 tokens, so a request holds at most a few blocks
    whatever its length: three 130-token sequences (90 on the interpreted Triton kernels) run
    through a 128-token pool (8 blocks of 16; 16-token chunks, so one sequence peaks at 4
    blocks), preempting one another, with transformers' greedy tokens, and every block is
    back in the pool at the end -- also with the engine's look-ahead (CUDA's default, forced
    here), which launches a step before the blocks behind the previous one's window are
    released, and with prompt-lookup drafts."""
    import os

    import transformers as tf

    from kvcap import SamplingParams

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set before triton is imported) or a GPU run")
    torch.manual_seed(0)
    hf = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=24)).float().eval()
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, COMMON["vocab_size"], (3, 60), generator=gen)
    hf.generation_config.eos_token_id = None  # as ignore_eos: 70 tokens each
    with torch.no_grad():
        want = [hf.generate(p[None], max_new_tokens=70, do_sample=False)[0, 60:].tolist()
                for p in prompts]
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path, num_blocks=8, max_num_batched_tokens=16,
                            attention_backend=backend, num_speculative_tokens=drafts)
    assert llm.block_manager.window == 24
    llm.engine.overlap = overlap
    # the interpreted kernels' run stops at 90 tokens (the window still slides past 3 x 24,
    # the three sequences still outgrow the pool): each step is ~0.1 s under the interpreter
    new = 30 if backend == "triton" else 70
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p.tolist() for p in prompts], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [w[:new] for w in want]
    assert (llm.engine.num_steps_ahead > 0) == overlap
    assert (llm.engine.num_draft_tokens > 0) == (drafts > 0)
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == 8


def test_qsa_refuses_a_sliding_window_model(tmp_path):
    import transformers as tf

    from kvcap.errors import ConfigError

    tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=24)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="QSA cannot serve a sliding-window model"):
        LLM(model=str(tmp_path), device="cpu", qsa="every4")


def test_max_model_len_past_the_position_limit_is_cut_and_said(caplog):
    from kvcap.config import ModelSpec
    from kvcap.llm import _max_model_len

    spec = ModelSpec.from_hf_config(_mini("llama"))
    with caplog.at_level("WARNING", logger="kvcap.llm"):
        assert _max_model_len(spec, 1000) == 256
    assert "exceeds the model's position limit" in caplog.text
    assert _max_model_len(spec, None) == 256 and _max_model_len(spec, 100) == 100


def test_yarn_extends_the_position_limit_as_qwen_configs_ask(tmp_path):
    # Qwen's long-context recipe: max_position_embeddings stays the trained length, YaRN's
    # factor extends it (as vLLM reads it). Capped at the trained 64 the 150-token prompt was
    # refused; past it the logits still match transformers'.
    import transformers as tf

    torch.manual_seed(0)
    cfg = {**COMMON, "max_position_embeddings": 64}
    hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(**cfg, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})).eval()
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 150), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path)
    assert llm.max_model_len == 256 == llm.spec.position_limit
    assert (llm.prompt_logits([ids[0].tolist()])[0] - ref).abs().max().item() < 1e-4


def test_position_limit_grows_only_under_yarn():
    from kvcap.config import ModelSpec

    def limit(rope, **kw):
        return ModelSpec.from_hf_config(_mini("llama", rope_scaling=rope, **kw)).position_limit

    assert limit(None) == 256
    assert limit({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}) == 256
    assert limit({"rope_type": "linear", "factor": 2.0}) == 256
    assert limit({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}) == 512
    # a config whose limit is already the extended one keeps it
    assert limit({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}) \
        == 256


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_missing_config_fields_take_transformers_defaults(arch):
    # a config.json without rms_norm_eps / max_position_embeddings reads as transformers
    # reads it for that architecture (Phi-3's eps is 1e-5, not Llama's 1e-6)
    import transformers as tf

    from kvcap.config import ModelSpec

    cfg = {k: v for k, v in _mini(arch).items()
           if k not in ("rms_norm_eps", "max_position_embeddings")}
    ref = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
           "qwen3": tf.Qwen3Config, "phi3": tf.Phi3Config}[arch]()
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.rms_norm_eps == ref.rms_norm_eps
    assert spec.max_position_embeddings == ref.max_position_embeddings


def test_generation_config_eos_ids_stop_generation(tmp_path):
    """generation_config.json's eos_token_id (where Llama-3 instruct checkpoints list <|eot_id|>)
    stops generation as config.json's does; a value that is no token id is refused by name."""
    import json

    from kvcap import SamplingParams

    torch.manual_seed(0)
    _build("llama").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path)
    free = llm.generate([[5, 6, 7]], params)[0]
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    stop = free.token_ids[2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path)
    out = llm.generate([[5, 6, 7]], params)[0]
    cut = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: cut + 1] and out.finish_reason == "stop"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelLoadError, match="eos_token_id '</s>' is not a token id"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


def test_weight_quantized_checkpoints_are_refused_by_name():
    """A checkpoint whose weights are quantized other than in FP8 (AWQ, bitsandbytes; the rest
    in tests/test_fp8_weights.py) is refused naming its method; a quantization_config declaring
    only a KV-cache scheme (vLLM-style FP8-KV checkpoints, kvcap's overlays) loads."""
    from kvcap.config import ModelSpec
    from kvcap.errors import ConfigError
    from kvcap.scales.overlay import vllm_quantization_config

    for qc in ({"quant_method": "awq", "bits": 4}, {"quant_method": "bitsandbytes"}):
        with pytest.raises(ConfigError, match=f"quant_method '{qc['quant_method']}'"):
            ModelSpec.from_hf_config(_mini("llama", quantization_config=qc))
    spec = ModelSpec.from_hf_config(_mini("llama", quantization_config=vllm_quantization_config()))
    assert spec.architecture == "llama"


def test_head_dims_the_kernels_cannot_tile_are_refused_before_loading(tmp_path):
    """A head_dim that is not a power of two from 16 to 256 (Phi-3-mini's 96, 24 here) is
    refused by name on the Triton backend and on CUDA, before the weights load; the CPU's torch
    backend runs it."""
    import json

    from kvcap.errors import ConfigError
    from kvcap.llm import _check_kernel_head_dim

    cfg = {"architectures": ["LlamaForCausalLM"], **COMMON, "hidden_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="head_dim 24: kvcap's Triton kernels need"):
        LLM(model=f"dummy:{tmp_path}", device="cpu", attention_backend="triton", num_blocks=8)
    assert LLM(model=f"dummy:{tmp_path}", device="cpu", num_blocks=8).spec.head_dim == 24
    for bad in (96, 8, 512):
        with pytest.raises(ConfigError, match=f"head_dim {bad}"):
            _check_kernel_head_dim(bad, "auto", torch.device("cuda"))
    for good in (16, 64, 128, 256):
        _check_kernel_head_dim(good, "auto", torch.device("cuda"))
    _check_kernel_head_dim(96, "auto", torch.device("cpu"))


@pytest.mark.parametrize("extra, message", [
    (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75"),  # Phi-4-mini's
    (dict(rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                        "original_max_position_embeddings": 64}), "'su' is LongRoPE"),
])
def test_phi3_rope_variants_kvcap_does_not_compute_are_refused(extra, message):
    from kvcap.config import ModelSpec
    from kvcap.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_hf_config(_mini("phi3", **extra))


def test_sliding_window_prefix_cache_hits_release_what_the_window_left(tmp_path, monkeypatch):
    """A second request sharing a 100-token prefix with a finished one finds its blocks in the
    prefix cache (released ones included: they stay cached), lists those behind its window
    as released at once (without taking them) and decodes the tokens it decodes without the
    cache."""
    import transformers as tf

    from kvcap import SamplingParams
    from kvcap.models import loader

    torch.manual_seed(0)
    tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=24)).save_pretrained(tmp_path)
    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, COMMON["vocab_size"], (100,), generator=gen).tolist()
    prompts = [prefix + [5, 6, 7], prefix + [8, 9]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(caching: bool):
        llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", num_blocks=32,
                  max_num_batched_tokens=32, enable_prefix_caching=caching)
        bm, hits = llm.block_manager, []
        admit = bm.allocate_prompt

        def recording(req, use_cache=True):
            ok = admit(req, use_cache)
            # (the cached blocks behind the window come back listed as released, never taken)
            assert bm.release_behind(req) == 0
            hits.append((req.num_cached_prefix_tokens, req.num_released_blocks))
            return ok
        bm.allocate_prompt = recording
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        bm.check_invariants([])
        return hits, [o.token_ids for o in outs]

    hits, got = run(True)
    assert got == run(False)[1]
    # the second admission: 96 cached tokens (6 blocks), 4 of them behind its window at once
    assert hits == [(0, 0), (96, 4)]
