"""`kvcap generate`: one prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path

from kvcap.commands.common import (
    add_engine_arguments,
    engine_kwargs,
    non_negative_float,
    positive_int,
)
from kvcap.errors import ConfigError

HELP = "generate text for one prompt, streaming it to stdout"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true",
                     help="JSON mode: the output is one JSON object (then it stops)")
    fmt.add_argument("--json-schema", metavar="FILE_OR_JSON",
                     help="the output is one JSON value valid under this JSON Schema: the "
                          "schema itself when the value parses as JSON (e.g. "
                          "'{\"type\": \"object\"}' or true), else the path of a UTF-8 file "
                          "holding it; a value that is both JSON and an existing file is "
                          "refused")
    fmt.add_argument("--choice", nargs="+", metavar="TEXT",
                     help="the output is exactly one of these strings")
    fmt.add_argument("--regex", metavar="PATTERN",
                     help="the output is text this regular expression matches whole")


def read_schema(arg: str | None):
    """--json-schema's value: inline JSON when it parses as JSON, else a file holding the
    schema. A value that is both (`true`, and a file of that name) is refused."""
    if arg is None:
        return None
    try:
        schema = json.loads(arg)
    except ValueError as e:
        if not os.path.exists(arg):
            raise ConfigError(f"--json-schema: {arg!r} is neither valid JSON ({e}) nor an "
                              "existing file") from None
    else:
        if os.path.exists(arg):
            raise ConfigError(f"--json-schema: {arg!r} is both inline JSON and an existing "
                              f"file: pass the file as ./{arg} (a path that is not JSON), or "
                              "the schema where no file has that name")
        return schema
    try:
        text = Path(arg).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--json-schema: cannot read {arg}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # (was a traceback)
        raise ConfigError(f"--json-schema: {arg} is not UTF-8 text (byte {e.start}: "
                          f"{e.reason}); save the schema as UTF-8") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--json-schema: {arg} is not valid JSON: {e}") from None


def _format_complete(llm, params, token_ids) -> bool:
    """Whether the output's tokens are a whole value of the request's structured format."""
    from kvcap.engine.token_bytes import TokenTexts

    grammar, texts = params.grammar(), TokenTexts(llm.tokenizer)
    state = grammar.start
    for tok in token_ids:
        state = grammar.feed(state, texts(tok)[1])
    return grammar.complete(state)


def run(args: argparse.Namespace) -> int:
    from kvcap.llm import LLM, check_text
    from kvcap.models.text_prompt import encode_prompt
    from kvcap.sampling_params import SamplingParams

    # bytes of argv that are not UTF-8 arrive as lone surrogates no tokenizer encodes
    check_text(args.prompt, "--prompt")

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            json_object=args.json, json_schema=read_schema(args.json_schema),
                            choice=args.choice, regex=args.regex)
    from kvcap.models.loader import DUMMY_PREFIX

    if str(args.model).startswith(DUMMY_PREFIX):
        # (its text prompt met a tokenizer of None deep inside: an AttributeError traceback)
        raise ConfigError(f"generate: {args.model} has random weights and no tokenizer to "
                          "encode --prompt with; use --model default or an HF checkpoint")
    if args.chat_template is not None and not args.chat:
        # (the template was read and then never used, without a word)
        print("warning: --chat-template applies with --chat only; the prompt is encoded as "
              "plain text", file=sys.stderr)
    llm = LLM(**engine_kwargs(args))
    if args.chat:
        ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        ids = encode_prompt(llm.tokenizer, args.prompt)  # as LLM.generate encodes it
    if hasattr(sys.stdout, "reconfigure"):
        # a stdout whose encoding lacks a character of the output (PYTHONIOENCODING=ascii, a
        # Latin-1 locale, a redirect on Windows) raised UnicodeEncodeError mid-output, a
        # traceback: such characters are written as backslash escapes (\xe9, \u597d) instead
        sys.stdout.reconfigure(errors="backslashreplace")
    rid = f"cli-{uuid.uuid4().hex[:8]}"
    llm.engine.add_request(rid, ids, params)
    printed, last = 0, None
    try:
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.request_id == rid:
                    sys.stdout.write(out.text[printed:])
                    sys.stdout.flush()
                    printed, last = len(out.text), out
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader left (`kvcap generate ... | head`): stop quietly, as a process killed by
        # SIGPIPE would (was a traceback); stdout goes to /dev/null so the exit flush is quiet
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 128 + 13  # SIGPIPE
    if last is not None and last.error:
        # the engine ended the request (a prompt the KV pool can never hold, an output no token
        # of the vocabulary can continue): was an empty line and exit 0, the reason only in a
        # log line
        hint = ("; give the KV cache more memory (--kv-cache-memory-gib, "
                "--gpu-memory-utilization) or ask for fewer tokens (--max-tokens, a shorter "
                "prompt)") if "KV blocks" in last.error else ""
        raise ConfigError(f"generate: {last.error.removeprefix('error: ')}{hint}")
    if (last is not None and last.finish_reason == "length"
            and len(last.token_ids) < params.max_tokens):
        # the context ended it before --max-tokens (the server refuses such a max_tokens; here
        # the output was cut short without a word)
        print(f"warning: stopped after {len(last.token_ids)} of --max-tokens {params.max_tokens}"
              f" tokens: the prompt's {len(ids)} tokens and the output reached max_model_len "
              f"{llm.engine.max_model_len} (--max-model-len)", file=sys.stderr)
    elif (last is not None and last.finish_reason == "length" and params.structured
          and not _format_complete(llm, params, last.token_ids)):
        # --json / --json-schema / --choice / --regex promise a whole value, but --max-tokens
        # cut it off mid-way (`{"name": "Ava", "desc`): exit 0 and not a word
        flag = next(f for f, v in (("--json", args.json), ("--json-schema", args.json_schema),
                                   ("--choice", args.choice), ("--regex", args.regex)) if v)
        print(f"warning: --max-tokens {params.max_tokens} ended the output before it was "
              f"complete under {flag}: raise --max-tokens", file=sys.stderr)
    e = llm.engine
    if e.num_draft_tokens:  # what speculative decoding did for this request
        print(f"speculative decoding: {e.num_accepted_tokens} of {e.num_draft_tokens} draft "
              f"tokens kept ({e.num_accepted_tokens / e.num_draft_tokens:.0%})", file=sys.stderr)
    return 0
