"""The CLI and the offline LLM API, second pass: arguments refused before the slow model load,
`apply_chat_template` reading messages as `chat` does, and `kvcap [-v | -q]`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_edge_cases import refused  # one `error:` line, exit 2, naming the problem

from kvcap import LLM, SamplingParams
from kvcap.cli import main
from kvcap.errors import ConfigError

SP = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64)


# --- LLM(kv_scales=...) ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    # a pack or scales without an E4M3 cache: refused after the weights and the KV pool
    (dict(kv_scales={"model.layers.0.self_attn.k_scale": 0.1}), "kv_cache_dtype is fp32"),
    (dict(kv_scales="/no/such/pack"), "kv_cache_dtype is fp32"),
    # an overlay pack for random weights
    (dict(kv_scales="/no/such/pack", kv_cache_dtype="fp8_e4m3"), "real checkpoint"),
    # a TypeError from inside pathlib, after the load
    (dict(kv_scales=5, kv_cache_dtype="fp8_e4m3"), "kv_scales must be"),
    (dict(kv_scales=["pack"], kv_cache_dtype="fp8_e4m3"), "kv_scales must be"),
])
def test_kv_scales_are_refused_before_the_weights_load(tiny, monkeypatch, kwargs, message):
    monkeypatch.setattr("kvcap.llm.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=message):
        LLM(model=tiny, device="cpu", num_blocks=8, **kwargs)


@pytest.mark.parametrize("pack", ["missing", "base"])
def test_a_path_that_is_no_overlay_pack_is_refused_before_the_weights_load(
        tiny_dir, tmp_path, monkeypatch, pack):
    """A mistyped pack folder, or the base checkpoint given as its own pack, was found out by
    the gate only after the weights loaded and the KV pool was allocated."""
    from kvcap.errors import OverlayError

    monkeypatch.setattr("kvcap.llm.load_model", lambda *a, **k: pytest.fail("model loaded"))
    path = tmp_path / "no-such-pack" if pack == "missing" else tiny_dir
    with pytest.raises(OverlayError, match="kvscales-manifest.json does not exist"):
        LLM(model=str(tiny_dir), device="cpu", num_blocks=8, kv_cache_dtype="fp8_e4m3",
            kv_scales=str(path))


def test_two_kv_pool_sizes_are_refused_not_one_dropped(tiny):
    """num_blocks won and kv_cache_memory_gib was dropped without a word."""
    with pytest.raises(ConfigError, match="both size the KV pool"):
        LLM(model=tiny, device="cpu", num_blocks=8, kv_cache_memory_gib=0.5)


def test_programmatic_scales_still_reach_the_gate(tiny):
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": 0.05 for i in range(2) for kv in "kv"}
    llm = LLM(model=tiny, device="cpu", num_blocks=8, kv_cache_dtype="fp8_e4m3",
              kv_scales=scales)
    assert llm.pool.scales_finalized


# --- vLLM's dict prompts -------------------------------------------------------------------------

def test_dict_prompts_run_as_the_text_or_ids_they_hold(llm):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids} were refused ("got dict"), so
    code written for vLLM's LLM.generate did not run on kvcap's."""
    ids = llm.tokenizer.encode("Say hi")
    want = [o.token_ids for o in llm.generate(["Say hi", ids], SP, use_tqdm=False)]
    got = llm.generate([{"prompt": "Say hi"}, {"prompt_token_ids": ids}], SP, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert [o.prompt_token_ids for o in got] == [ids, ids]
    one = llm.generate({"prompt_token_ids": ids}, SP, use_tqdm=False)
    assert [o.token_ids for o in one] == want[1:]


# --- apply_chat_template ------------------------------------------------------------------------

def test_apply_chat_template_reads_messages_as_chat_does(llm):
    # it rendered the messages raw: content parts were refused by the template, `developer`
    # reached it as an unknown role -- other ids than chat() generated from
    plain = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hi"}]
    openai = [{"role": "developer", "content": [{"type": "text", "text": "Be brief"}]},
              {"role": "user", "content": [{"type": "text", "text": "Say "},
                                           {"type": "text", "text": "hi"}]}]
    want = llm.apply_chat_template(plain)
    assert llm.apply_chat_template(openai) == want
    assert llm.chat(openai, SP, use_tqdm=False)[0].prompt_token_ids == want


@pytest.mark.parametrize("conversation", ["hi", None, [{"role": "user", "content": "hi"}, "x"]])
def test_apply_chat_template_refuses_what_is_no_conversation(llm, conversation):
    with pytest.raises(ConfigError, match="conversation must be a list"):
        llm.apply_chat_template(conversation)


# --- kvcap serve ----------------------------------------------------------------------------------

def test_serve_refuses_a_bad_generation_config_before_the_model_loads(
        tiny_dir, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    gen = model / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "temperature": -1.0}))
    monkeypatch.setattr("kvcap.commands.serve.check_listen_address", lambda host, port: None)
    monkeypatch.setattr("kvcap.llm.LLM.__init__", lambda *a, **k: pytest.fail("model loaded"))
    refused(capsys, "temperature", "serve", "--model", str(model), "--device", "cpu",
            "--port", "0")


# --- kvcap [-v | -q] ------------------------------------------------------------------------------

def test_verbose_and_quiet_together_are_refused(capsys: pytest.CaptureFixture) -> None:
    # both were taken, -v won and -q was dropped without a word
    with pytest.raises(SystemExit) as e:
        main(["-v", "-q", "envelope", "--reports", "a.json", "--out", "b.json"])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
