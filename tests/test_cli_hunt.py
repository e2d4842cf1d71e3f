"""Bad input to the command line and the LLM API, as a user gives it: one `error:` line (exit 2)
or a ConfigError that names the problem -- never a traceback from deep inside, never a silent
fallback, and a failed call leaves nothing queued behind it."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report
from test_cli_edge_cases import refused  # one `error:` line, exit 2, naming the problem

from kvcap import LLM, SamplingParams
from kvcap.cli import main
from kvcap.errors import ConfigError
from kvcap.scales.overlay import write_overlay

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            eos_token_id=2)


@pytest.fixture
def dummy(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return f"dummy:{tmp_path / 'config.json'}"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64)


SP = SamplingParams(max_tokens=2, temperature=0.0)


# --- the command line ---------------------------------------------------------------------------

def test_unwritable_output_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # (/proc takes no new directory: the staging mkdir's FileNotFoundError was a traceback)
    base = make_checkpoint(tmp_path / "base")
    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report(base)))
    refused(capsys, "/proc/", "overlay", "--model", str(base), "--report", str(report),
            "--out", "/proc/kvcap-hunt-pack")


def test_generate_into_a_closed_pipe_stops_quietly(tiny_dir, monkeypatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    # `kvcap generate ... | head -c 1`: was a BrokenPipeError traceback
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no fd")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    rc = main(["-q", "generate", "--model", str(tiny_dir), "--device", "cpu", "--prompt", "hi",
               "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_generate_prompt_with_undecodable_bytes_is_one_line(tiny_dir,
                                                            capsys: pytest.CaptureFixture) -> None:
    # argv bytes that are not UTF-8 arrive as lone surrogates: the tokenizer's TypeError
    refused(capsys, "--prompt", "generate", "--model", str(tiny_dir), "--device", "cpu",
            "--max-tokens", "2", "--prompt", "hi \udcff")


def test_generate_json_schema_file_not_utf8(tiny_dir, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    schema = tmp_path / "schema.json"
    schema.write_bytes(b'\xff\xfe{"type": "string"}')
    refused(capsys, "--json-schema", "generate", "--model", str(tiny_dir), "--device", "cpu",
            "--max-tokens", "2", "--prompt", "hi", "--json-schema", str(schema))


def test_generate_json_schema_is_inline_json_or_a_file(tiny_dir, tmp_path: Path, monkeypatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """--json-schema is the schema when it parses as JSON, else a file: `true` (a valid
    schema) was read as a file name ('cannot read true'), as was any JSON not starting with
    '{'. A value that is both is refused, naming both readings; --help says the rule."""
    import argparse

    from kvcap.commands import generate

    monkeypatch.chdir(tmp_path)
    assert generate.read_schema("true") is True
    assert generate.read_schema(' {"type": "object"}') == {"type": "object"}
    (tmp_path / "s.json").write_text('{"type": "string"}')
    assert generate.read_schema("s.json") == {"type": "string"}
    (tmp_path / "true").write_text('{"type": "string"}')
    with pytest.raises(ConfigError, match=r"^--json-schema: 'true' is both inline JSON and an "
                                          r"existing file: pass the file as \./true"):
        generate.read_schema("true")
    assert generate.read_schema("./true") == {"type": "string"}
    with pytest.raises(ConfigError, match=r"is neither valid JSON \(Expecting ',' delimiter"):
        generate.read_schema('{"type": "object"')
    refused(capsys, "'nope.json' is neither valid JSON (Expecting value", "generate", "--model",
            str(tiny_dir), "--device", "cpu", "--prompt", "hi", "--json-schema", "nope.json")
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    assert "when the value parses as JSON" in " ".join(p.format_help().split())


@pytest.mark.parametrize("argv", [
    ["verify", "--device", "cpu"],
    ["overlay", "--unit-scale-negative-control", "--out", "{tmp}/pack"],
    ["materialize", "--overlay", "{tmp}/pack", "--out", "{tmp}/derived"],
    ["compare", "--overlay", "{tmp}/pack", "--out", "{tmp}/cmp"],
    ["demo", "--out", "{tmp}/demo"],
])
def test_checkpoint_commands_say_a_dummy_model_is_not_a_checkpoint(
        dummy: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # (was "model path 'dummy:...' does not exist", of a file that exists)
    err = refused(capsys, "random weights", *[a.format(tmp=tmp_path) for a in argv],
                  "--model", dummy)
    assert "does not exist" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_compare_control_and_no_control_conflict(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    # --no-control silently dropped the --control pack given beside it
    base = make_checkpoint(tmp_path / "base")
    pack = write_overlay(base, tmp_path / "pack", make_report(base))
    refused(capsys, "--no-control", "compare", "--model", str(base), "--overlay", str(pack),
            "--control", str(pack), "--no-control", "--out", str(tmp_path / "cmp"))
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("key", ["", "  ", " secret", "sécret"])
def test_serve_refuses_an_api_key_no_client_can_send(tiny_dir, monkeypatch, key: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    # "" switched the key check off without a word; a padded or non-ASCII key never matched
    monkeypatch.setattr("kvcap.commands.serve.check_listen_address", lambda host, port: None)
    monkeypatch.setattr("kvcap.llm.LLM.__init__", lambda *a, **k: pytest.fail("model loaded"))
    refused(capsys, "--api-key", "serve", "--model", str(tiny_dir), "--device", "cpu",
            "--port", "0", "--api-key", key)


def test_serve_refuses_an_empty_served_model_name(tiny_dir, monkeypatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("kvcap.commands.serve.check_listen_address", lambda host, port: None)
    monkeypatch.setattr("kvcap.llm.LLM.__init__", lambda *a, **k: pytest.fail("model loaded"))
    refused(capsys, "--served-model-name", "serve", "--model", str(tiny_dir), "--device", "cpu",
            "--port", "0", "--served-model-name", "")


def test_serve_refuses_a_host_of_another_machine(monkeypatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    # (192.0.2.1, TEST-NET-1, is no address of this machine: the message said "pick another
    # --port" about a port that was free)
    monkeypatch.setattr("kvcap.llm.LLM.__init__", lambda *a, **k: pytest.fail("model loaded"))
    err = refused(capsys, "--host '192.0.2.1' is not an address of this machine", "serve",
                  "--device", "cpu", "--host", "192.0.2.1", "--port", "0")
    assert "another --port" not in err


@pytest.mark.parametrize("template, message", [
    ('{{ raise_exception("System role not supported") }}', "System role not supported"),
    ("{{ messages[0].content + 1 }}", "concatenate"),   # a TypeError inside jinja
    ("{{ messages[3].content }}", "no element 3"),      # an UndefinedError
])
def test_generate_chat_template_that_refuses_is_one_line(tiny_dir, template: str, message: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    # templates refuse conversations they do not take by raising: was a traceback from inside
    # jinja (the server answers the same with a 400)
    refused(capsys, message, "-q", "generate", "--model", str(tiny_dir), "--device", "cpu",
            "--max-tokens", "2", "--prompt", "hi", "--chat", "--chat-template", template)


def test_generate_prompt_the_kv_pool_cannot_hold_is_an_error(tiny_dir,
                                                             capsys: pytest.CaptureFixture
                                                             ) -> None:
    # one 16-token block (256 bytes a token): the engine ends the 40-token request with an
    # error, which was an empty line on stdout and exit 0
    err = refused(capsys, "--kv-cache-memory-gib", "-q", "generate", "--model", str(tiny_dir),
                  "--device", "cpu", "--kv-cache-memory-gib", str(4096 / 2**30),
                  "--max-tokens", "2", "--prompt", "word " * 40)
    assert "KV blocks" in err


def test_generate_cut_by_the_context_says_so(tiny_dir, capsys: pytest.CaptureFixture) -> None:
    # --max-tokens 50 after a 21-token prompt in a 32-token context: 11 tokens, exit 0, and
    # not a word that --max-tokens was not reached
    rc = main(["-q", "generate", "--model", str(tiny_dir), "--device", "cpu",
               "--max-model-len", "32", "--max-tokens", "50", "--prompt", "word " * 20])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "warning: stopped after 11 of --max-tokens 50" in err and "max_model_len 32" in err
    rc = main(["-q", "generate", "--model", str(tiny_dir), "--device", "cpu",
               "--max-model-len", "32", "--max-tokens", "5", "--prompt", "word " * 20])
    assert rc == 0 and "warning" not in capsys.readouterr().err


def test_generate_structured_output_cut_by_max_tokens_says_so(tiny_dir,
                                                              capsys: pytest.CaptureFixture
                                                              ) -> None:
    # --json promises one JSON object; --max-tokens 3 printed a fragment of one with exit 0
    # and not a word
    argv = ["-q", "generate", "--model", str(tiny_dir), "--device", "cpu", "--prompt", "hi"]
    assert main([*argv, "--max-tokens", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    with pytest.raises(ValueError):
        json.loads(out)
    assert "warning: --max-tokens 3 ended the output before it was complete under --json" in err
    # a whole value at exactly --max-tokens (one digit, no room left for EOS) is not warned of
    assert main([*argv, "--max-tokens", "1", "--regex", "[0-9]"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().isdigit() and "warning" not in err


def test_generate_to_a_stdout_that_cannot_encode_the_text(tiny_dir, monkeypatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    # PYTHONIOENCODING=ascii, a Latin-1 locale: a UnicodeEncodeError traceback mid-output
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    rc = main(["-q", "generate", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens",
               "4", "--prompt", "hi", "--choice", "caf\u00e9"])
    assert rc == 0, capsys.readouterr().err
    out.flush()
    assert out.buffer.getvalue() == b"caf\\xe9\n"


def test_generate_checkpoint_without_tokenizer_is_one_line(tiny_dir, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    # transformers' "Couldn't instantiate the backend tokenizer" runs over five lines
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    refused(capsys, "tokenizer files", "-q", "generate", "--model", str(tmp_path), "--device",
            "cpu", "--max-tokens", "2", "--prompt", "hi")


# --- the LLM API --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, message", [
    (b"hi", "bytes"),                      # was read as token ids [104, 105]
    ([b"hi"], "bytes"),
    ([[1.7, 2.2]], "float"),               # was truncated to [1, 2]
    ([[True, False]], "bool"),             # was [1, 0]
    ([["1", "2"]], "str"),                 # was parsed to [1, 2]
    (torch.tensor([1, 2, 3]), "tolist"),   # a RuntimeError from the tensor's truth value
    (None, "NoneType"),                    # TypeError / KeyError from inside
    (5, "int"),
    ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),  # (vLLM's; dropped)
    ([{"prompt_token_ids": "hi"}], "prompt_token_ids must be a list"),
    ([{"prompt": [1, 2]}], "prompt must be a string"),
    ([{}], "one key"),
    ([None], "NoneType"),
    (["hi \udcff"], "UTF-8"),              # the tokenizer's TypeError
])
def test_generate_refuses_prompts_it_cannot_read(llm, prompts, message):
    with pytest.raises(ConfigError, match=message):
        llm.generate(prompts, SP, use_tqdm=False)


@pytest.mark.parametrize("params", [{"max_tokens": 2}, [None], [{"max_tokens": 2}]])
def test_generate_refuses_params_that_are_not_sampling_params(llm, params):
    # (an AttributeError: 'dict' object has no attribute 'logit_bias')
    with pytest.raises(ConfigError, match="SamplingParams"):
        llm.generate(["hi"], params, use_tqdm=False)


@pytest.mark.parametrize("prompts, params", [
    (["a", "b", ""], SP),
    ([[1, 2], list(range(3, 300))], SP),  # longer than the context
])
def test_a_refused_batch_leaves_nothing_queued(llm, prompts, params):
    # the prompts before the bad one stayed queued and ran in the next generate()
    with pytest.raises(ConfigError, match="prompt 1|prompt 2"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("messages", ["hi", ["hi"], [{"role": "user", "content": "hi"}, "x"]])
def test_chat_refuses_messages_that_are_not_dicts(llm, messages):
    with pytest.raises(ConfigError, match="message"):
        llm.chat(messages, SP, use_tqdm=False)


def test_prompt_logits_refuses_text_and_flat_ids(llm):
    for bad in (["hi"], [1, 2]):
        with pytest.raises(ConfigError, match="token"):
            llm.prompt_logits(bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=None), "model"),
    (dict(model=5), "model"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(enforce_eager="no"), "enforce_eager"),
    (dict(kv_observer=5), "kv_observer"),
])
def test_llm_refuses_arguments_of_the_wrong_type(dummy, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(**{"model": dummy, "device": "cpu", "num_blocks": 8, **kwargs})


def test_token_ids_in_every_integer_form_still_run(llm):
    import numpy as np

    ref = llm.generate([[1, 2, 3]], SP, use_tqdm=False)[0].token_ids
    for ids in ([torch.tensor([1, 2, 3])], [np.array([1, 2, 3])], [range(1, 4)],
                [[np.int64(1), 2, 3]], (1, 2, 3)):
        assert llm.generate(ids, SP, use_tqdm=False)[0].token_ids == ref
    assert llm.prompt_logits([torch.tensor([1, 2, 3])])[0].shape[0] == 3
