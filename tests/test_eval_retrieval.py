"""Retrieval case generator: determinism, exact lengths, needle placement, scoring."""

from __future__ import annotations

import re

import pytest

from kvcap.errors import ConfigError
from kvcap.eval import retrieval


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from kvcap.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def cases(tok):
    return retrieval.build_cases(tok, ["passkey", "kv"], [512, 1024])


def test_deterministic(tok, cases):
    again = retrieval.build_cases(tok, ["passkey", "kv"], [512, 1024])
    assert [(c.case_id, c.prompt_ids, c.answer) for c in again] == \
           [(c.case_id, c.prompt_ids, c.answer) for c in cases]


def test_grid_and_exact_length(cases):
    assert len(cases) == 2 * 2 * len(retrieval.DEPTHS)
    for c in cases:
        assert len(c.prompt_ids) + retrieval.MAX_NEW_TOKENS == c.context
        assert c.provenance["generator"] == f"retrieval.{c.task}"


def test_needle_at_depth(tok, cases):
    for task in ("passkey", "kv"):
        group = [c for c in cases if c.task == task and c.context == 1024]
        positions = [c.needle_token for c in group]
        assert positions == sorted(positions) and positions[0] < positions[-1]
        for c in group:
            window = tok.decode(c.prompt_ids[c.needle_token:c.needle_token + 24])
            assert c.answer in window
            frac = c.needle_token / len(c.prompt_ids)
            assert abs(frac - c.depth / 100) < 0.1


def test_secrets_differ_across_cases(cases):
    answers = [c.answer for c in cases if c.task == "passkey"]
    assert len(set(answers)) > len(answers) // 2


def test_score():
    case = retrieval.RetrievalCase("passkey", 512, 50, [1], "48213", 0)
    assert retrieval.score(case, " 48213. Remember")
    assert not retrieval.score(case, " 4821")
    assert not retrieval.score(case, " 148213")
    assert not retrieval.score(case, " no idea")
    kv = retrieval.RetrievalCase("kv", 512, 50, [1], "a1b2c3", 0)
    assert retrieval.score(kv, 'a1b2c3",')
    assert not retrieval.score(kv, 'a1b2c4"')
    assert retrieval.score(kv, " a1b2c3") and retrieval.score(kv, "a1b2c3 is the value")
    assert not retrieval.score(kv, 'a1b2c3d",')  # a 7-digit value was scored right
    assert not retrieval.score(kv, "a1b2c3F")


def test_validate_contexts():
    assert retrieval.validate_contexts([2048, 1024, 1024], 8192) == [1024, 2048]
    with pytest.raises(ConfigError, match="exceeds the model's window"):
        retrieval.validate_contexts([16384], 8192)
    with pytest.raises(ConfigError, match="below the minimum"):
        retrieval.validate_contexts([64], 8192)


def test_unknown_task(tok):
    with pytest.raises(ConfigError, match="unknown retrieval task"):
        retrieval.build_cases(tok, ["needle"], [512])


def _sentencepiece_like():
    """A byte-fallback BPE built as Llama-2's fast tokenizer is: every text gets a leading
    "▁", so "\\n" encodes as ["▁", "<0x0A>"] and "▁" alone decodes to nothing."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "\u2581": 259, "\u2581\u2581": 260}
    tk = Tokenizer(models.BPE(vocab, [("\u2581", "\u2581")], unk_token="<unk>",
                              byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                          normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_kv_padding_is_newlines_with_a_sentencepiece_tokenizer(tok):
    """The key-value case pads with the token that decodes to "\\n": it took the first token
    of "\\n", which a SentencePiece tokenizer makes the leading-space piece (padding of
    spaces, not newlines)."""
    sp = _sentencepiece_like()
    assert sp("\n", add_special_tokens=False)["input_ids"] == [259, 13]
    case = retrieval.kv_case(sp, 512, 50, 0)
    assert len(case.prompt_ids) + retrieval.MAX_NEW_TOKENS == 512
    text = sp.decode(case.prompt_ids)
    assert re.search(r'",\n\n{8,} }\n\nWhat is the value of key', text), text[-200:]
    assert retrieval.newline_token(sp) == 13
    assert tok.decode([retrieval.newline_token(tok)]) == "\n"  # the default's one token


def test_kv_padding_refuses_a_tokenizer_without_a_newline_token():
    class NoNewline:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [5, 6] if text == "\n" else [1]}

        def decode(self, ids):
            return " "

    with pytest.raises(ConfigError, match=r"no token of this tokenizer decodes to a newline on "
                                          r"its own \('\\n' encodes as \[5, 6\]\)"):
        retrieval.newline_token(NoNewline())
