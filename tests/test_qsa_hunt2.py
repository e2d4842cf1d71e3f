"""QSA: bugs found by a second correctness hunt (each test failed before its fix)."""

from __future__ import annotations

import pytest
import test_qsa_engine
import torch
from test_qsa_engine import _llm, _prompts

from kvcap.attention.torch_ref import attend_reference
from kvcap.errors import ConfigError
from kvcap.qsa.backend import attend_masked_reference
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.enable import parse_preset

tiny_model = test_qsa_engine.tiny_model  # the tiny random Llama (module-scoped fixture)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_masked_reference_with_every_token_is_the_dense_reference_bit_for_bit(n):
    """attend_masked_reference ran per-query-head [Hq, n, D] matmuls while the dense
    reference groups query heads by KV head ([Hkv, group * n, D]): other GEMM shapes, whose
    sums differed in the last bit at 3-4 query rows, so a QSA budget covering the context
    was not dense attention exactly (its documented rule)."""
    g = torch.Generator().manual_seed(n)
    hq, hkv, d, ctx = 6, 2, 16, 7
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(hkv, ctx + n, d, generator=g)
    v = torch.randn(hkv, ctx + n, d, generator=g)
    dense = attend_reference(q, k, v, ctx, 0.25)
    causal = torch.arange(ctx + n)[None, :] <= ctx + torch.arange(n)[:, None]  # [n, S]
    for hs in (1, hkv):  # one selection for all KV heads (trained), or one per KV head
        mask = causal[:, None, :].expand(n, hs, ctx + n)
        assert torch.equal(attend_masked_reference(q, k, v, mask, 0.25), dense)


def test_masked_reference_keeps_each_kv_heads_own_selection():
    """The regrouped layout still applies mask row r / KV head h to exactly that pair."""
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, s = 3, 6, 2, 8, 10
    q, k, v = (torch.randn(n, hq, d, generator=g), torch.randn(hkv, s, d, generator=g),
               torch.randn(hkv, s, d, generator=g))
    mask = torch.rand(n, hkv, s, generator=g) < 0.5
    mask[:, :, 0] = True
    got = attend_masked_reference(q, k, v, mask, 0.3)
    for r in range(n):
        for h in range(hq):
            j = h // (hq // hkv)
            sel = mask[r, j]
            p = torch.softmax(k[j, sel] @ q[r, h] * 0.3, dim=0)
            torch.testing.assert_close(got[r, h], p @ v[j, sel], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("summary", ["minmax", "mean"])
def test_budget_covering_short_prompts_equals_dense_bit_for_bit(tiny_model, summary):
    """Through the engine: 3- and 4-token prompts (and others) under a budget covering the
    context gave logits 1e-7 off the dense LLM's."""
    prompts = _prompts(0, [1, 2, 3, 4, 5, 7, 17])
    dense = _llm(tiny_model).prompt_logits(prompts)
    cfg = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=64, summary=summary)
    qsa = _llm(tiny_model, qsa=cfg).prompt_logits(prompts)
    for a, b in zip(dense, qsa, strict=True):
        assert torch.equal(a, b)


def test_refrun_refuses_a_budget_covering_the_run(capsys):
    """Only rows with more than --topk groups are scored: with none, both arms ran and then
    selection_overlap raised a bare RuntimeError (max() of an empty tensor)."""
    from kvcap.qsa import refrun

    with pytest.raises(SystemExit) as e:
        refrun.main(["--prompt", "32", "--decode", "1", "--chunk", "32", "--topk", "16"])
    assert e.value.code == 2 and "--topk 16" in capsys.readouterr().err


def test_recall_refuses_budgets_covering_the_context(tiny_model, capsys):
    """A budget with no row choosing was a ZeroDivisionError after the model ran: now a
    usage error before the model loads, and measure() says so for prompts too short."""
    from kvcap.qsa import recall

    with pytest.raises(SystemExit) as e:
        recall.main(["--context", "128", "--budgets", "16,32"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--budgets 32" in err and "below 32" in err
    llm = _llm(tiny_model, attention_backend="torch")
    with pytest.raises(ConfigError, match="budget 8 groups .* covers every row"):
        recall.measure(llm, _prompts(1, [30]), [8], every=1)


def test_recall_on_a_model_under_three_layers_has_no_late_mean(tmp_path):
    """mean_from_layer_2 divided by the count of layers >= 2: a ZeroDivisionError after the
    whole run on a 2-layer model."""
    import json

    from kvcap.qsa import recall

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**test_qsa_engine.TINY, "num_hidden_layers": 2}))
    llm = _llm(f"dummy:{path}", attention_backend="torch")
    res = recall.measure(llm, _prompts(1, [120]), [4], every=1)
    assert res and all(r["mean_from_layer_2"] is None and 0.0 <= r["mean"] <= 1.0
                       for r in res.values())


def test_needle_recall_mean_without_counted_rows_is_none(tiny_dir):
    """With a budget covering the context no row is counted: the mean mass recall was
    reported as 0.0 (sum / max(n, 1)), i.e. as if QSA captured none of the attention."""
    from kvcap.qsa import needle

    cfg = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=40,
                    summary="minmax").validate()
    dense, qsa = needle.build_pair(str(tiny_dir), 128, cfg)
    res = needle.run_needle(dense, qsa, cfg, 128, [50])
    assert res["recall"] == {} and res["recall_mean"] is None
    assert res["cases"][0]["same_tokens"]  # the budget covers it: QSA is dense


@pytest.mark.parametrize("argv, load_error, message", [
    # enable_qsa's budget check came after both models had loaded, as a traceback
    (["--context", "64", "--topk", "1024"], AssertionError("the models were loaded"),
     "exceeds the context"),
    # --first-dense past the model's layers (enable_qsa) or a --context too short for a
    # passkey case were ConfigError tracebacks
    (["--context", "256", "--first-dense", "30"],
     ConfigError("QSA config selects no layer of a 30-layer model"), "selects no layer"),
])
def test_needle_bad_arguments_are_usage_errors(capsys, monkeypatch, argv, load_error, message):
    from kvcap.qsa import needle

    def load(*a, **k):
        raise load_error

    monkeypatch.setattr(needle, "build_pair", load)
    with pytest.raises(SystemExit) as e:
        needle.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["every\u0664", "every\uff14:1024",
                                  "every4:\u0661\u0660\u0662\u0664", "all-but-\u0968"])
def test_presets_take_ascii_digits_only(name):
    """\\d matched any Unicode digit: 'every\\u0664' (Arabic-Indic 4) was every4."""
    with pytest.raises(ConfigError, match="bad QSA preset"):
        parse_preset(name)
    assert parse_preset("every4:1024").topk_groups == 256
