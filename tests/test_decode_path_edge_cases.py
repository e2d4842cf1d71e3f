"""Edge cases of the decode path: streamed text against one decode of the whole output, special
tokens in structured output, and sampling at a vanishing temperature."""

from __future__ import annotations

import torch

from kvcap import SamplingParams
from kvcap.engine.detokenizer import IncrementalDetokenizer
from kvcap.engine.structured import StructuredOutput
from kvcap.engine.token_bytes import TokenTexts
from kvcap.models.loader import load_tokenizer
from kvcap.sampling.sampler import Sampler, SamplingBatch


def _cleanup_tokenizer():
    """A tokenizer whose config asks to clean up tokenization spaces (" ." -> "."), as Llama
    3's does; transformers 5 skips that for BPE models only, so this one is word-level."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "Hello", "\u0120", ".", "\u0120world", "\u0120it", "\u0120'", "s", "\u0120?"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=True)


def test_streamed_text_never_loses_what_cleanup_rewrites():
    tok = _cleanup_tokenizer()
    for ids in ([1, 2, 3, 4], [5, 6, 7, 4], [1, 2, 8, 4]):  # "Hello . world", " it 's world"
        detok = IncrementalDetokenizer(tok)
        for n in range(1, len(ids) + 1):
            streamed = detok.update(ids[:n])
            whole = tok.decode(ids[:n], clean_up_tokenization_spaces=False)
            assert whole.startswith(streamed), (ids[:n], streamed, whole)
        # the final text extends what was streamed (before: "Hello  world" streamed, then
        # "Hello. world" as the final text)
        assert detok.finish(ids) == tok.decode(ids, clean_up_tokenization_spaces=False)
        assert detok.text.startswith(streamed)


def test_added_special_tokens_never_fit_structured_output(default_model_dir):
    """SmolLM's <filename> (like Llama 3's <|start_header_id|>) is an added special token
    outside all_special_ids: JSON mode took it as string content, which the text then drops
    (skip_special_tokens), so the text was not the JSON the grammar checked."""
    tok = load_tokenizer(default_model_dir)
    filename = tok.convert_tokens_to_ids("<filename>")
    assert filename not in tok.all_special_ids and tok.decode(
        [filename], skip_special_tokens=True) == ""
    texts = TokenTexts(tok)
    assert filename in texts.special_ids
    grammar = SamplingParams(json_object=True).grammar()
    inside_string = grammar.feed(grammar.start, b'{"a": "')
    out = StructuredOutput(texts, len(tok), set(tok.all_special_ids) & {tok.eos_token_id})
    assert out.next_state(grammar, inside_string, filename) is None
    assert out.next_state(grammar, inside_string, tok.encode("a")[0]) is not None


def test_vanishing_temperature_samples_the_argmax():
    """logits / 1e-39 overflows float32: every token with a logit above ~0.34 became the same
    FLT_MAX and the lowest index among them won, whatever the seed."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 3
    want = int(logits.argmax())
    sampler = Sampler("cpu")
    for t in (1e-39, 1e-30, 1e-6):
        for seed in range(4):
            batch = SamplingBatch.from_params([SamplingParams(temperature=t)], [seed], [0], "cpu")
            assert int(sampler.sample(logits, batch)[0]) == want, (t, seed)
    # a small but ordinary temperature still samples
    hot = SamplingBatch.from_params([SamplingParams(temperature=1e-3)], [0], [0], "cpu")
    assert not hot.all_greedy and float(hot.temperature[0]) > 0
