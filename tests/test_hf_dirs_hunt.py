"""HF-format directories as transformers itself writes and reads them, against transformers'
own logits: a sharded save re-saved as one file (the stale index it leaves behind), a config
that carries both rope_parameters and a hand-added rope_scaling, ..."""

from __future__ import annotations

import json

import pytest
import torch
from test_models_tiny import COMMON, _init_without_tokenizer

from kvcap import LLM


def _hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits[0].float()


def _ids(n: int = 60) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(1))


def _kvcap_logits(path, ids: torch.Tensor, **kw) -> torch.Tensor:
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, path, **kw)
    return llm.prompt_logits([ids[0].tolist()])[0]


def test_a_sharded_save_resaved_as_one_file_loads_as_transformers_loads_it(tmp_path):
    """save_pretrained(max_shard_size=...) then save_pretrained() into the same directory (a
    fine-tune saved over its base): transformers deletes the old shards but leaves their
    model.safetensors.index.json, and loads the new model.safetensors (it prefers the single
    file). kvcap read the stale index first and refused the directory: 'index names files that
    are missing'."""
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path,
                                                                  max_shard_size="30KB")
    torch.manual_seed(1)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not list(tmp_path.glob("model-0*.safetensors"))
    ids = _ids()
    ours = _kvcap_logits(tmp_path, ids)
    assert (ours - _hf_logits(tmp_path, ids)).abs().max().item() < 1e-4


def test_an_index_naming_missing_shards_without_a_single_file_is_still_refused(tmp_path):
    """The fallback above is for a model.safetensors beside the index only: a shard missing
    from a sharded checkpoint (a partial download) stays an error naming it."""
    import transformers as tf

    from kvcap.errors import ModelLoadError

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path,
                                                                  max_shard_size="30KB")
    (tmp_path / "model-00002-of-00012.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing.*model-00002-of-00012"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}])
def test_rope_scaling_added_to_a_transformers5_config_is_not_ignored(tmp_path, rope):
    """A config.json saved by transformers 5 carries "rope_parameters": {"rope_type":
    "default", ...}; a user then adds "rope_scaling" as model cards say (Qwen2.5's README:
    add a yarn rope_scaling to config.json for long context). transformers applies the
    rope_scaling; kvcap took rope_parameters first and silently ran unscaled RoPE (and kept
    the unextended position limit)."""
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default"
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = _ids(200)
    ours = _kvcap_logits(tmp_path, ids)
    assert (ours - _hf_logits(tmp_path, ids)).abs().max().item() < 1e-4


def test_a_qwen3_config_without_head_dim_reads_transformers_default(tmp_path):
    """Qwen3's head_dim is not hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim
    128); transformers' Qwen3Config defaults it to 128 when config.json leaves it out and
    loads such a checkpoint, kvcap derived 64 and refused it with a shape mismatch."""
    import transformers as tf

    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=128)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = _ids()
    ours = _kvcap_logits(tmp_path, ids)
    assert (ours - _hf_logits(tmp_path, ids)).abs().max().item() < 1e-4


def test_an_index_naming_model_safetensors_itself_still_refuses_its_missing_files(tmp_path):
    """A materialized overlay's index names model.safetensors and its scale file: with the
    scale file gone, falling back to model.safetensors alone would drop the scales; it stays
    an error naming the missing file."""
    import transformers as tf

    from kvcap.errors import ModelLoadError

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        weight_map = dict.fromkeys(st.keys(), "model.safetensors")
    weight_map["model.layers.0.self_attn.k_scale"] = "model-kvscales.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="missing.*model-kvscales"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)



def test_an_adapter_file_beside_model_safetensors_is_ignored_as_transformers_does(tmp_path):
    """Without an index transformers reads model.safetensors alone; kvcap read every
    *.safetensors, so a PEFT adapter_model.safetensors beside it failed the load as an
    'unexpected tensor ... wrong architecture or config?' naming neither file nor cause."""
    import transformers as tf
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.zeros(4, COMMON["hidden_size"])}, str(tmp_path / "adapter_model.safetensors"))
    ids = _ids()
    assert (_kvcap_logits(tmp_path, ids) - _hf_logits(tmp_path, ids)).abs().max().item() < 1e-4
