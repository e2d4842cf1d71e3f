"""QSA edge cases: the side caches follow the rollback switch and `enable_qsa` /
`disable_qsa` (prefix cache), and bad configurations are one-line ConfigErrors."""

from __future__ import annotations

import json

import pytest
import torch
from test_qsa_engine import TINY

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError
from kvcap.qsa.config import ENV_DISABLE_QSA, QSAConfig
from kvcap.qsa.enable import disable_qsa, enable_qsa
from kvcap.qsa.synthetic import make_backend, make_cache, make_steps, run_steps

SMALL = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=4, summary="minmax")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsa_edge") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def _shared_prefix_pair():
    """Two prompts sharing 6 full blocks (96 tokens) of prefix."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 320, (96,), generator=g).tolist()
    return (shared + torch.randint(0, 320, (21,), generator=g).tolist(),
            shared + torch.randint(0, 320, (17,), generator=g).tolist())


def _logprobs(out):
    return [next(iter(d.values())) for d in out.logprobs]


def _assert_same(got, want):
    assert got.token_ids == want.token_ids
    assert max(abs(x - y) for x, y in zip(_logprobs(got), _logprobs(want), strict=True)) < 1e-4


def _llm(model, **kw):
    return LLM(model=model, num_blocks=64, max_num_batched_tokens=48, **kw)


def test_enable_qsa_after_dense_requests_drops_their_prefix_blocks(tiny_model):
    """Blocks cached by dense requests have no rows in the new side caches (zeros) and K/V
    computed without QSA: a prefix hit on them must not change QSA's output."""
    a, b = _shared_prefix_pair()
    fresh = _llm(tiny_model, enable_prefix_caching=False)
    enable_qsa(fresh, SMALL)
    want = fresh.generate([b], GREEDY, use_tqdm=False)[0]
    llm = _llm(tiny_model)
    llm.generate([a], GREEDY, use_tqdm=False)  # dense: caches the shared blocks
    enable_qsa(llm, SMALL)
    _assert_same(llm.generate([b], GREEDY, use_tqdm=False)[0], want)


def test_disable_qsa_drops_prefix_blocks_computed_with_qsa(tiny_model):
    """After disable_qsa the model is dense: a hit on blocks whose deeper layers' K/V were
    computed through QSA layers must not leak QSA into the dense output."""
    a, b = _shared_prefix_pair()
    want = _llm(tiny_model).generate([b], GREEDY, use_tqdm=False)[0]
    llm = _llm(tiny_model)
    enable_qsa(llm, SMALL)
    llm.generate([a], GREEDY, use_tqdm=False)
    disable_qsa(llm)
    _assert_same(llm.generate([b], GREEDY, use_tqdm=False)[0], want)


def test_rollback_switch_flip_drops_prefix_blocks_of_the_other_mode(tiny_model, monkeypatch):
    """KVCAP_DISABLE_QSA flipped between requests: a prefix hit must not reuse K/V computed
    through QSA layers in a dense request (log-probs were off by up to 0.08), nor the reverse."""
    monkeypatch.delenv(ENV_DISABLE_QSA, raising=False)
    a, b = _shared_prefix_pair()
    dense = _llm(tiny_model).generate([b], GREEDY, use_tqdm=False)[0]
    fresh = _llm(tiny_model, enable_prefix_caching=False)
    enable_qsa(fresh, SMALL)
    sparse = fresh.generate([b], GREEDY, use_tqdm=False)[0]
    llm = _llm(tiny_model)
    enable_qsa(llm, SMALL)
    llm.generate([a], GREEDY, use_tqdm=False)  # QSA: caches the shared blocks
    monkeypatch.setenv(ENV_DISABLE_QSA, "1")
    _assert_same(llm.generate([b], GREEDY, use_tqdm=False)[0], dense)
    llm.generate([a], GREEDY, use_tqdm=False)  # dense: caches them again
    monkeypatch.delenv(ENV_DISABLE_QSA)
    _assert_same(llm.generate([b], GREEDY, use_tqdm=False)[0], sparse)


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_rollback_switch_keeps_side_caches_current(monkeypatch, summary):
    """Steps run while KVCAP_DISABLE_QSA=1 still write the side rows: once the switch is off
    again, the same sequence selects (and attends) exactly as if QSA had never been off."""
    cfg = QSAConfig(layer_rule="explicit", layers=(0,), topk_groups=2, summary=summary,
                    path="torch")
    nb, bs, hkv, d = 12, 8, 2, 16
    runs = []
    for off_first in (False, True):
        steps = make_steps([[37], [1], [5], [1]], [44], 4, hkv, d, bs, nb, torch.float16,
                           torch.Generator().manual_seed(3), integer=False)
        be = make_backend(cfg, nb, bs, hkv, d)
        cache = make_cache(nb, hkv, bs, d, "fp16")
        if off_first:
            monkeypatch.setenv(ENV_DISABLE_QSA, "1")
            st = steps[0]  # dense prefill
            be.forward(st.q, st.k, st.v, cache, st.meta, d ** -0.5, torch.empty_like(st.q))
            monkeypatch.delenv(ENV_DISABLE_QSA)
            runs.append(run_steps(be, cache, steps[1:], d ** -0.5))
        else:
            runs.append(run_steps(be, cache, steps, d ** -0.5)[1:])
    for (out_a, tok_a), (out_b, tok_b) in zip(*runs, strict=True):
        assert torch.equal(tok_a, tok_b)
        assert torch.equal(out_a, out_b)


def test_include_tail_false_is_refused():
    """Without the open tail, rows 0..2 select no token (softmax over nothing: NaN logits)
    and no row sees itself, so even a budget covering the context is not dense."""
    with pytest.raises(ConfigError, match="include_tail=True"):
        QSAConfig(include_tail=False).validate()
    QSAConfig(include_tail=False, compress_ratio=1).validate()  # every token is a group


@pytest.mark.parametrize("kw,match", [
    (dict(topk_groups=2.5), "topk_groups must be an integer"),
    (dict(topk_groups="512"), "topk_groups must be an integer"),
    (dict(every_n=4.0), "every_n must be an integer"),
    (dict(layer_rule="all_but_first", first_dense=True), "first_dense must be an integer"),
    (dict(compress_ratio=4.0), "compress_ratio must be an integer"),
    (dict(layer_rule="explicit", layers=3), "layers must be a tuple"),
    (dict(layer_rule="explicit", layers=("3",)), "layers must be a tuple"),
    (dict(layers=(1, 3)), "only read with layer_rule='explicit'"),
])
def test_bad_config_values_are_one_line_config_errors(tiny_model, kw, match):
    """Before: TypeErrors (a float budget only in the first forward, inside torch.full) or,
    for `layers` without the explicit rule, QSA silently on other layers."""
    with pytest.raises(ConfigError, match=match) as e:
        LLM(model=tiny_model, num_blocks=8, qsa=QSAConfig(**kw))
    assert "\n" not in str(e.value)


def test_enable_qsa_refuses_a_sliding_window_model(tmp_path):
    """As LLM(qsa=...) does; before, the first forward failed with a ValueError on layer 0,
    which is not even a QSA layer."""
    cfg = dict(TINY, architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=f"dummy:{tmp_path}", num_blocks=16)
    with pytest.raises(ConfigError, match="sliding-window"):
        enable_qsa(llm, SMALL)


def test_triton_path_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="path='auto' or 'torch'"):
        make_backend(QSAConfig(layer_rule="explicit", layers=(0,), path="triton"), 4, 16, 1, 8)


def test_enable_qsa_refuses_a_speculative_llm(tiny_model):
    """As LLM(qsa=...) does; before, enable_qsa installed QSA beside prompt-lookup drafts and
    the keys of rejected drafts stayed in the side rows: greedy log-probs moved by 0.13 from
    the same model without drafts, on a repetitive prompt."""
    llm = _llm(tiny_model, num_speculative_tokens=3)
    dense = llm.runner.backend
    with pytest.raises(ConfigError, match="cannot run with QSA") as e:
        enable_qsa(llm, SMALL)
    assert "\n" not in str(e.value)
    assert llm.runner.backend is dense


def test_enable_qsa_drops_piecewise_graphs_of_the_dense_backend(tiny_model):
    """A CUDA LLM holds decode graphs and piecewise prefill graphs, both recording the dense
    backend. enable_qsa with the torch path (which graphs cannot record) dropped only the
    decode graphs: prefill and mixed steps still ran through the dense pieces, so QSA layers
    attended densely there and decode selected from side rows never written (log-probs off
    by 0.1 from both QSA and dense). Simulated on the CPU: the pieces run as plain calls."""
    from kvcap.engine.piecewise_graph import PiecewiseGraphs, token_buckets

    cfg = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=4, summary="minmax",
                    path="torch")
    a, b = _shared_prefix_pair()
    want = _llm(tiny_model, qsa=cfg, enable_prefix_caching=False).generate(
        [a, b], GREEDY, use_tqdm=False)
    llm = _llm(tiny_model, enable_prefix_caching=False)
    runner = llm.runner
    runner.token_buckets = token_buckets(llm.config.max_num_batched_tokens)
    pieces = PiecewiseGraphs(llm.model, runner.backend, llm.pool, torch.device("cpu"),
                             runner.token_buckets, graphs=False)
    with torch.inference_mode():
        pieces.capture()
    runner.piecewise = pieces
    runner.graphs = object()  # as captured decode graphs: enable_qsa re-records or drops them
    enable_qsa(llm, cfg)
    assert runner.graphs is None and runner.piecewise is None
    for got, ref in zip(llm.generate([a, b], GREEDY, use_tqdm=False), want, strict=True):
        _assert_same(got, ref)
