"""Checkpoints as users bring them, against transformers: a tied config whose safetensors carry
an lm_head.weight (distinct, identical, or in place of the embedding), a checkpoint with more
layers than its config names, one without tokenizer files, a rope_scaling missing a key."""

from __future__ import annotations

import json

import pytest
import torch
from test_models_tiny import COMMON, _init_without_tokenizer

from kvcap import LLM
from kvcap.config import ModelSpec
from kvcap.errors import ModelLoadError
from kvcap.models.registry import build_model
from kvcap.models.weights import dummy_checkpoint, load_weights

TIED = {**COMMON, "tie_word_embeddings": True}


def _tied_llama(tmp_path, edit):
    """A tiny tied Llama saved by transformers (embed_tokens only), its safetensors then
    changed by `edit(state_dict)`; returns (kvcap's prompt logits, transformers' logits)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**TIED)).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(f)
    assert "lm_head.weight" not in state
    edit(state)
    save_file(state, f, metadata={"format": "pt"})
    ids = torch.randint(0, TIED["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path)
    return llm, llm.prompt_logits([ids[0].tolist()])[0], ref


def test_tied_config_with_a_distinct_lm_head_uses_it_as_transformers_does(tmp_path):
    """tie_word_embeddings true, but the checkpoint holds a real, different lm_head.weight (a
    fine-tune that untied the head and kept the config): transformers keeps the checkpoint's
    head (PreTrainedModel.tie_weights: 'we will NOT tie them'); kvcap used to drop it and
    decode through the embedding, silently."""
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(TIED["vocab_size"], TIED["hidden_size"], generator=gen)
    llm, ours, ref = _tied_llama(tmp_path, lambda s: s.__setitem__("lm_head.weight", head))
    assert (ours - ref).abs().max().item() < 1e-4
    assert llm.model.lm_head.weight is not llm.model.embed_tokens.weight


def test_tied_config_with_an_identical_lm_head_stays_tied(tmp_path):
    """Both tensors present and equal (what a .bin conversion writes): one shared parameter."""
    llm, ours, ref = _tied_llama(tmp_path, lambda s: s.__setitem__(
        "lm_head.weight", s["model.embed_tokens.weight"].clone()))
    assert (ours - ref).abs().max().item() < 1e-4
    assert llm.model.lm_head.weight is llm.model.embed_tokens.weight


def test_tied_config_with_only_an_lm_head_ties_to_it(tmp_path):
    """Only lm_head.weight in the checkpoint: transformers ties the embedding to it."""
    llm, ours, ref = _tied_llama(tmp_path, lambda s: s.__setitem__(
        "lm_head.weight", s.pop("model.embed_tokens.weight")))
    assert (ours - ref).abs().max().item() < 1e-4
    assert llm.model.lm_head.weight is llm.model.embed_tokens.weight


def test_tied_config_with_a_distinct_lm_head_under_tensor_parallelism():
    """A rank's vocabulary slice of the distinct head lands in its own untied head."""
    from kvcap.distributed.comm import Communicator
    from kvcap.distributed.layers import ModelParallel
    from kvcap.distributed.partition import plan_shard

    cfg = {**TIED, "architectures": ["LlamaForCausalLM"]}
    spec = ModelSpec.from_hf_config(cfg)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    head = torch.randn(spec.vocab_size, spec.hidden_size, generator=gen)
    stream = [*dummy_checkpoint(spec, cpu, torch.float32, seed=1), ("lm_head.weight", head)]
    shard = plan_shard(spec, 2, 1)
    part = build_model(spec, cpu, torch.float32, ModelParallel(shard, Communicator(1, 2, cpu)))
    load_weights(part, stream)
    lo, hi = shard.vocab
    assert torch.equal(part.lm_head.weight, head[lo:hi])
    assert part.lm_head.weight is not part.embed_tokens.weight


def test_a_checkpoint_with_more_layers_than_the_config_is_refused_by_name(tmp_path):
    """config.json's num_hidden_layers cut below the checkpoint's (a truncated config, or the
    wrong one): a ModelLoadError naming the tensor, not a bare IndexError from the layer list
    (a shard that starts inside a layer gives q/k/v or gate/up names first)."""
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 4})).save_pretrained(
        tmp_path, max_shard_size="60KB")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.[23]\..*num_hidden_layers 2"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_checkpoint_without_tokenizer_files_is_refused_saying_so(arch, tmp_path,
                                                                   default_model_dir):
    """config.json + safetensors but no tokenizer files (a partial download or copy). For a
    Qwen2 config transformers 5 builds an *empty* tokenizer (one special token, id 0) rather
    than fail: kvcap used to serve with it -- every prompt encoded to no tokens ('the prompt is
    empty') and token 0 an end-of-sequence id. For Llama its error spoke of sentencepiece and
    tiktoken, not of the missing files. Both now say what is missing; with the files copied
    in, the same directory loads."""
    import shutil

    import transformers as tf

    from kvcap.models import loader

    torch.manual_seed(0)
    model, cfg = {"qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),
                  "llama": (tf.LlamaForCausalLM, tf.LlamaConfig)}[arch]
    model(cfg(**COMMON)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer files"):
        loader.load_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    assert len(loader.load_tokenizer(tmp_path)) > 1000


@pytest.mark.parametrize("rope, key", [({"rope_type": "linear"}, "factor"),
                                       ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor")])
def test_rope_scaling_without_a_key_its_type_needs_is_refused_by_name(rope, key, tmp_path):
    """A rope_scaling dict missing a key its type needs: a ModelLoadError naming the type and
    the key, not a bare KeyError from the frequency computation."""
    (tmp_path / "config.json").write_text(json.dumps(
        {**COMMON, "architectures": ["LlamaForCausalLM"], "rope_scaling": rope}))
    with pytest.raises(ModelLoadError, match=f"rope_scaling .*{rope['rope_type']}.*'{key}'"):
        LLM(model=f"dummy:{tmp_path}", device="cpu", num_blocks=8)


@pytest.mark.parametrize("content", ["[1, 2]", '"llama"'])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, content):
    from kvcap.models.loader import read_spec

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match="not an object"):
        read_spec(tmp_path)
