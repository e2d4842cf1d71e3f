"""Token bytes (what structured output checks) against the text kvcap returns (the incremental
detokenizer's), on byte-level BPE, SentencePiece BPE and Unigram tokenizers with byte fallback
and added tokens (special and not, Latin-1 / CJK / leading spaces), built offline."""

from __future__ import annotations

import random
import re

import pytest

from kvcap.engine.detokenizer import IncrementalDetokenizer
from kvcap.engine.token_bytes import TokenTexts

CORPUS = ["Grüße aus Köln — naïve café, 東京 and emoji 🚀🎉! def f(x):\n    return x ** 2\n",
          "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
          "  leading spaces and\ttabs\n\nnewlines {\"a\": 1, \"b\": [true, null]}",
          "Ça va? Ünïcödé ÿ ñ ß æøå €100 ¥200 £3 ©®"] * 10
TEXT = "Grüße aus Köln — naïve café, 東京 and emoji 🚀🎉! def f(x):\n  ÿ <tool> Ça va 𝄞漢"


def _added():
    from tokenizers import AddedToken

    return [AddedToken("<|eot|>", special=True), AddedToken("<|é|>", special=True),
            AddedToken("café", special=False), AddedToken(" naïve", special=False),
            AddedToken("東京", special=False), AddedToken("<tool>", special=False),
            AddedToken("ÿ", special=False), AddedToken("\u2581zz", special=False)]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<unk>"]))
    tk.add_tokens(_added())
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eot|>")


def _spiece(unigram: bool):
    """Llama 2 style: "\u2581" for a space, <0xNN> byte fallback, a decoder that strips the
    text's first space."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                 normalizers.Replace(" ", "\u2581")])
    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tk = Tokenizer(models.Unigram() if unigram else models.BPE())
    tk.normalizer = norm
    trainer = (trainers.UnigramTrainer(vocab_size=300, special_tokens=specials, unk_token="<unk>")
               if unigram else trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tk.train_from_iterator(CORPUS, trainer)
    model = json.loads(tk.to_str())["model"]
    if unigram:
        vocab = [(p, 0.0) for p in specials + byte_pieces]
        vocab += [tuple(v) for v in model["vocab"] if v[0] not in specials]
        tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    else:
        vocab = {p: i for i, p in enumerate(specials + byte_pieces)}
        for p in model["vocab"]:
            vocab.setdefault(p, len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in model["merges"]]
        tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                  fuse_unk=True))
    tk.normalizer = norm
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(specials)
    tk.add_tokens(_added())
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


_BUILDERS = {"byte_level": _byte_level, "spiece_bpe": lambda: _spiece(False),
             "spiece_unigram": lambda: _spiece(True)}
_CACHE: dict = {}


@pytest.fixture(params=["byte_level", "spiece_bpe", "spiece_unigram", "smollm2"])
def tok(request, tmp_path_factory):
    name = request.param
    if name not in _CACHE:
        from kvcap.models.loader import load_tokenizer, resolve_model_dir

        if name == "smollm2":
            _CACHE[name] = load_tokenizer(resolve_model_dir("default"))
        else:  # saved and loaded back the way kvcap loads a checkpoint's tokenizer
            d = tmp_path_factory.mktemp(name)
            _BUILDERS[name]().save_pretrained(d)
            _CACHE[name] = load_tokenizer(d)
    return _CACHE[name]


def _is_byte_token(tok, t: int) -> bool:
    return re.fullmatch(r"<0x[0-9A-F]{2}>", tok.convert_ids_to_tokens(t) or "") is not None


def _random_ids(tok, rng: random.Random, ordinary: list[int]) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    start = rng.randrange(len(ids))
    ids = ids[start:start + rng.randint(1, 16)]
    ids += [rng.choice(ordinary) for _ in range(rng.randint(0, 10))]
    if rng.random() < 0.3:
        rng.shuffle(ids)
    return ids


def test_token_bytes_add_up_to_the_output_text(tok):
    """Any sequence of ordinary tokens whose bytes are valid UTF-8 (all structured output can
    make) is exactly that text as kvcap returns it: the SentencePiece first token's leading
    space included (the grammar checked it), added tokens' (Latin-1, CJK, leading-space) text
    as the decoder renders it."""
    texts = TokenTexts(tok)
    ordinary = [t for t in range(len(tok)) if t not in texts.special_ids]
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        ids = [rng.choice(ordinary) for _ in range(rng.randint(1, 6))]
        try:
            want = b"".join(bytes(texts(t)[1]) for t in ids).decode()
        except UnicodeDecodeError:
            continue
        checked += 1
        assert IncrementalDetokenizer(tok).finish(ids) == want, tok.convert_ids_to_tokens(ids)
    assert checked > 300


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_never_rewritten(tok, skip):
    """Each step's text extends the last one's and the final text extends them all (the server
    streams text[len(sent):]): a SentencePiece byte run ("V" as <0x56>, then <0x8D>) is
    rendered as one U+FFFD per byte once it is not valid UTF-8, so text streamed from the run
    ("V", or a whole character before a stray lead byte) was rewritten afterwards."""
    ordinary = list(range(len(tok)))
    rng = random.Random(1)
    for _ in range(150):
        ids = _random_ids(tok, rng, ordinary)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        seen = ""
        for n in range(1, len(ids) + 1):
            text = detok.update(ids[:n])
            assert text.startswith(seen), (tok.convert_ids_to_tokens(ids[:n]), seen, text)
            seen = text
        final = detok.finish(ids)
        assert final.startswith(seen), (tok.convert_ids_to_tokens(ids), seen, final)
        # the final text is the whole output's decode, a first SentencePiece space kept
        assert final == IncrementalDetokenizer(tok, skip_special_tokens=skip).finish(ids)


def test_byte_fallback_run_then_invalid_byte(tok):
    texts = TokenTexts(tok)
    if not texts.sentencepiece:
        pytest.skip("no byte fallback")
    ids = [tok.convert_tokens_to_ids(p) for p in ("<0x56>", "<0x8D>")]
    detok = IncrementalDetokenizer(tok)
    streamed = detok.update(ids[:1])
    streamed = detok.update(ids)
    final = detok.finish(ids)
    assert final.startswith(streamed) and final == tok.decode(ids)  # "\ufffd\ufffd"
    east = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "東".encode()]
    ids = east + [tok.convert_tokens_to_ids("<0xE4>"), tok.convert_tokens_to_ids("a")]
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        streamed = detok.update(ids[:n])
    final = detok.finish(ids)
    assert final.startswith(streamed), (streamed, final)


def test_sentencepiece_first_token_keeps_its_space(tok):
    """"\u2581hello" first: the grammar saw " hello", so the text is " hello" (as vLLM's,
    which decodes after the prompt); decoding the output alone dropped the space."""
    texts = TokenTexts(tok)
    if not texts.sentencepiece:
        pytest.skip("not SentencePiece")
    ids = tok.encode(" the lazy dog", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    want = b"".join(bytes(texts(t)[1]) for t in ids).decode()
    assert want.startswith(" ")
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        assert want.startswith(detok.update(ids[:n]))
    assert detok.finish(ids) == want


def test_stop_strings_found_where_the_full_text_has_them(tok):
    """The stop string's offset in the streamed text is its offset in the final text."""
    ids = tok.encode(" hello there! The quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        text = detok.update(ids[:n])
        final = IncrementalDetokenizer(tok).finish(ids[:n])
        for stop in ("there", "!", " The", "fox"):
            if stop in text:
                assert text.find(stop) == final.find(stop)


@pytest.fixture(scope="module")
def spiece_llm(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcap import LLM

    tok = _spiece(False)
    d = tmp_path_factory.mktemp("spiece_model")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return LLM(model=str(d))


def test_sentencepiece_regex_with_a_leading_space_matches_the_text(spiece_llm):
    """The grammar accepted "\u2581and" as " and"; the output text was "and" (no match)."""
    from kvcap import SamplingParams

    pattern = " [a-z]{1,4}"
    for seed in range(4):
        out = spiece_llm.generate(["hello"], SamplingParams(
            temperature=1.0, seed=seed, max_tokens=12, regex=pattern), use_tqdm=False)[0]
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), (out.text, out.token_ids)

