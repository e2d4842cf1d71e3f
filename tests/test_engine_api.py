"""The LLM API on the embedded model: bad input gets a one-line error and nothing crashes
the engine for other requests; seeded sampling is reproducible and batch-independent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcap import LLM, SamplingParams
from kvcap.engine.prefix_view import PrefixView
from kvcap.errors import ConfigError


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=96)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=1e39), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(top_k=-3), "top_k must be"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be true or false"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be true or false"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(llm):
    ok_ids = llm.tokenizer.encode("Hello there")
    llm.engine.add_request("ok", ok_ids, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ConfigError, match="does not fit the context"):
        llm.engine.add_request("too-long", [1] * 400, SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError, match="prompt token ids must be in"):
        llm.engine.add_request("bad-id", [10**9], SamplingParams(max_tokens=4))
    finished = []
    while llm.engine.has_unfinished():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"]
    assert len(finished[0].token_ids) == 4 or finished[0].finish_reason == "stop"
    assert llm.block_manager.num_used_blocks == 0


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=12,
                       ignore_eos=True)
    alone = llm.generate(["Tell me a story about a cat"], p, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Tell me a story about a cat", "Why is the sky blue?"],
                         [p, others], use_tqdm=False)
    assert batch[0].token_ids == alone
    assert len(set(alone)) > 1


def test_stop_strings_and_logprobs(llm):
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=3, prompt_logprobs=2,
                       ignore_eos=True)
    out = llm.generate(["Count: 1, 2, 3, 4,"], p, use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and lp[tok] <= 0.0 and len(lp) >= 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(
        out.prompt_token_ids)
    stop = out.text[5:8]
    out2 = llm.generate(["Count: 1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=24,
                        stop=[stop], ignore_eos=True), use_tqdm=False)[0]
    assert out2.finish_reason == "stop" and stop not in out2.text
    assert out.text.startswith(out2.text)


def test_unstreamed_requests_give_one_final_output_equal_to_the_streamed(llm):
    """add_request(stream=False) (LLM.generate, a server reply sent whole): no output until
    the request ends, and then the same tokens, text, logprobs and reason as streamed."""
    ids = llm.tokenizer.encode("Count: 1, 2, 3, 4,")
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, stop=[" 7"],
                             ignore_eos=True)]
    seen: dict[str, list] = {}
    for i, p in enumerate(params):
        for stream in (True, False):
            llm.engine.add_request(f"s{i}-{stream}", ids, p, stream=stream)
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            seen.setdefault(o.request_id, []).append(o)
    for i in range(len(params)):
        streamed, whole = seen[f"s{i}-True"], seen[f"s{i}-False"]
        assert len(streamed) > 1 and len(whole) == 1 and whole[0].finished
        a, b = streamed[-1], whole[0]
        assert (a.token_ids, a.text, a.logprobs, a.finish_reason) == \
            (b.token_ids, b.text, b.logprobs, b.finish_reason)
        # while running, views that keep their length as the request grows; lists at the end
        for j, o in enumerate(streamed[:-1]):
            assert isinstance(o.token_ids, PrefixView) and not o.finished
            assert list(o.token_ids) == b.token_ids[:len(o.token_ids)]
            assert len(o.token_ids) == len(streamed[j + 1].token_ids) - 1 or \
                streamed[j + 1].finished
            if b.logprobs is not None:
                assert list(o.logprobs) == b.logprobs[:len(o.token_ids)]
        assert type(a.token_ids) is list and type(b.token_ids) is list


def test_logprobs_of_a_batch_equal_each_request_alone(llm):
    """Rows asking for different numbers of alternatives share one top-k pass per step
    (values within FP32 batching noise: a batched matmul rounds differently)."""
    prompts = ["Count: 1, 2, 3,", "The sky is", "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=n, ignore_eos=True)
              for n in (1, 4, 0)]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = llm.generate(prompts + ["No logprobs here"], params + [plain], use_tqdm=False)
    for prompt, p, got in zip(prompts, params, batch, strict=False):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert got.token_ids == alone.token_ids
        for d, a, tok in zip(got.logprobs, alone.logprobs, got.token_ids, strict=True):
            assert d.keys() == a.keys() and len(d) in (p.logprobs, p.logprobs + 1) and tok in d
            assert list(d.values()) == pytest.approx(list(a.values()), abs=1e-4)
    assert batch[3].logprobs is None


def test_prompt_logits_in_row_blocks_equal_one_block(llm, monkeypatch):
    """Teacher-forced logits are computed PROMPT_LOGITS_ROWS rows at a time (memory beside the
    KV pool); blocks that split prefill chunks unevenly give the same logprobs and logits."""
    import torch

    from kvcap.engine import model_runner

    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)

    def run():
        return llm.generate([ids], p, use_tqdm=False, want_prompt_logits=True)[0]

    whole = run()
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 7)
    sliced = run()
    assert len(ids) > 3 * 7 and len(sliced.prompt_logprobs) == len(ids)
    # CPU BLAS may round a 7-row product differently from the whole chunk's in the last bits
    # (seen on some Xeons): same entries, values to 1e-4; a misplaced row differs by far more.
    for a, b in zip(sliced.prompt_logprobs, whole.prompt_logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4
    torch.testing.assert_close(sliced.prompt_logits, whole.prompt_logits, rtol=0, atol=1e-4)
    for k in range(1, len(ids)):  # each position's dict holds the prompt's next token
        assert ids[k] in sliced.prompt_logprobs[k]


@pytest.mark.parametrize("drafts", [0, 4])
def test_cli_generate_answers_capital_of_france(drafts):
    """Also with speculative decoding: the same answer, and a line on the drafts kept."""
    res = subprocess.run(
        [sys.executable, "-m", "kvcap.cli", "-q", "generate", "--model", "default", "--device",
         "cpu", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "24",
         "--num-speculative-tokens", str(drafts)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout
    assert ("draft tokens kept" in res.stderr) == (drafts > 0), res.stderr[-500:]


def test_cli_unknown_model_is_one_line_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "generate", "--model",
                          str(tmp_path / "missing"), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: model path")
    assert "Traceback" not in res.stderr



def test_chat_without_a_chat_template_is_a_one_line_error(default_model_dir, tmp_path):
    """A base model's tokenizer has no chat template: chat says so and how to give one (was
    transformers' ValueError from deep inside apply_chat_template)."""
    import json

    from server_helpers import make_tiny_model

    path = make_tiny_model(default_model_dir, tmp_path / "base")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    base = LLM(model=str(path), device="cpu", num_blocks=16)
    with pytest.raises(ConfigError, match="has no chat template .*--chat-template"):
        base.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("device, message", [
    ("mps", "kvcap runs on cuda or cpu"),
    ("nope", "device 'nope': "),
    pytest.param("cuda", "sees no CUDA GPU", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="a GPU is visible")),
])
def test_a_device_that_is_not_there_is_a_one_line_error(default_model_dir, device, message):
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(default_model_dir), device=device)
