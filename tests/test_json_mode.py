"""JSON mode: the byte-level recogniser against Python's json module, the token choice with
masking and the whole-vocabulary fallback, and generation on the embedded model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.engine.json_mode import MAX_REJECTIONS, JsonMode
from kvcap.engine.token_bytes import TokenTexts
from kvcap.errors import ConfigError
from kvcap.sampling.json_prefix import START, complete, feed


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "obj":
        return {f"k{rng.randint(0, 99)}\u00e9\"\\": _random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return rng.choice(["", "plain", "tab\t\nnew", "\u4e16\u754c", "quote\"back\\slash",
                           "\u0001ctl"])
    if kind == "num":
        return rng.choice([0, -0.5, 12, 3.25e-7, -1e21, 1.5e300, 7])
    return rng.choice([True, False, None])


def test_every_prefix_of_valid_objects_is_accepted_and_only_the_end_is_complete():
    rng = random.Random(0)
    for i in range(200):
        doc = {"root": _random_value(rng)} if i % 2 else dict(a=_random_value(rng))
        text = json.dumps(doc, indent=rng.choice([None, 2]), ensure_ascii=i % 3 == 0,
                          separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
        data = text.encode()
        state = START
        for k, b in enumerate(data):
            state = feed(state, bytes([b]))
            assert state is not None, (text, k)
            assert complete(state) == (k == len(data) - 1), (text, k)


@pytest.mark.parametrize("text", [
    "[1]", '"s"', "1", '{"a" 1}', '{"a":01}', '{"a":1,}', '{"a":tru}', "{a:1}",
    '{"a":"\x01"}', '{"a":1}}', '{"a":-}', '{"a":1.}', '{"a":1e}', '{"a":.5}', '{"a":+1}',
    '{"a":"\\x"}', '{"a":"\\u12g4"}', '{,}', '{"a":[1,]}', '{"a":[,1]}', '{"a":1 2}',
    '{"a":nul}', '{"a":truex}', "{" + " " * 40 + "}",
])
def test_invalid_json_is_refused(text):
    assert feed(START, text.encode()) is None  # refused at the first byte that breaks it


def test_recogniser_never_completes_what_json_rejects():
    rng = random.Random(1)
    alphabet = b'{}[]:,"\\ 0123456789.eE+-truefalsnul\tabc'
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 16)))
        state = feed(START, data)
        if complete(state):
            assert isinstance(json.loads(data), dict), data


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=512, num_blocks=64)


def test_choose_masks_a_misfit_and_falls_back_to_the_full_mask(llm):
    texts = TokenTexts(llm.tokenizer)
    v = llm.spec.vocab_size
    mode = JsonMode(texts, v, llm.runner.eos_token_ids)
    brace = llm.tokenizer.convert_tokens_to_ids("{")
    logits = torch.zeros(v)
    logits[brace] = 5.0
    # greedy: a non-fitting token first, then the brace
    tok, state = mode.choose(START, 30, logits, lambda row: int(torch.argmax(row)))
    assert tok == brace and state is not None and mode.num_rejections == 1
    # the best MAX_REJECTIONS + 3 tokens all misfit: the step takes the full mask
    bad = [t for t in range(200, 2000) if mode.next_state(START, t) is None][:MAX_REJECTIONS + 3]
    logits = torch.zeros(v)
    logits[bad] = torch.arange(len(bad), 0, -1, dtype=torch.float32) + 10
    logits[brace] = 1.0
    tok, _ = mode.choose(START, bad[0], logits, lambda row: int(torch.argmax(row)))
    assert tok == brace and mode.num_full_masks == 1
    done = feed(START, b"{}")
    assert mode.choose(done, brace, logits, lambda row: 0)[0] in llm.runner.eos_token_ids
    eos = min(llm.runner.eos_token_ids)
    assert mode.next_state(START, eos) is None  # EOS never fits an unfinished object


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_is_one_json_object(llm, temperature):
    msgs = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name, "
                                        "age and colour. Answer with JSON only."}]
    p = SamplingParams(temperature=temperature, seed=4, max_tokens=120, json_object=True)
    out = llm.chat(msgs, p, use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
    free = llm.chat(msgs, SamplingParams(temperature=temperature, seed=4, max_tokens=120),
                    use_tqdm=False)[0]
    if free.text.lstrip().startswith("{"):  # where the model wrote JSON anyway: same text
        try:
            json.loads(free.text)
        except ValueError:
            return
        assert out.text.strip() == free.text.strip()


def test_json_object_refuses_ignore_eos():
    with pytest.raises(ConfigError, match="json_object ends the output with EOS"):
        SamplingParams(json_object=True, ignore_eos=True)


def test_sentencepiece_token_bytes():
    """U+2581 is a space and <0xNN> a raw byte (Llama 2 / Mistral 7B tokenizers)."""

    class Decoder:
        def __getstate__(self):
            return '{"type":"Sequence","decoders":[{"type":"Replace","content":" ",' \
                   '"pattern":{"String":"\u2581"}},{"type":"ByteFallback"}]}'.encode()

    class Backend:
        decoder = Decoder()

    class Tok:
        backend_tokenizer = Backend()
        all_special_ids = [2]
        pieces = {5: "\u2581hello", 6: "<0xE4>", 7: "{", 2: "</s>"}

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

        def decode(self, ids):
            return "</s>"

    texts = TokenTexts(Tok())
    assert texts.sentencepiece and not texts.byte_level
    assert texts(5) == (" hello", list(b" hello"))
    assert texts(6)[1] == [0xE4] and texts(7)[1] == list(b"{")
    assert texts(2) == ("</s>", list(b"</s>"))  # a special token: its text
