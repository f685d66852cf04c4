"""`deepinfer-recipe encode|decode` — for people debugging prompts, and for oracle tests.

    encode: request JSON on stdin → {"token_ids", "prompt", "control_ranges", ...} on stdout
    decode: output token ids (a JSON list, or {"token_ids": [...], "request": {...}}) on stdin
            → the protocol's final response object
Errors go to stderr and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .encoders import get_encoder
from .errors import RecipeError
from .protocols import PROTOCOLS, parse_request


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer-recipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("encode", "request JSON → prompt token ids"), ("decode", "output ids → final response")):
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--format", required=True, help="deepseek-v4 | deepseek-v4.1 | hf:PATH")
        command.add_argument("--protocol", choices=PROTOCOLS, default="chat")
        command.add_argument("--tokenizer", help="tokenizer.json to use instead of the format's own")
        command.add_argument("--model", default="", help="model name to report (decode)")
    return parser


def _encode(args, data) -> dict:
    encoder = get_encoder(args.format, args.tokenizer)
    return encoder.encode(parse_request(args.protocol, data)).to_json()


def _decode(args, data) -> dict:
    from .output import OutputSession

    if isinstance(data, list):
        ids, request = data, None
    elif isinstance(data, dict) and isinstance(data.get("token_ids"), list):
        ids, request = data["token_ids"], data.get("request")
    else:
        raise RecipeError('decode expects a JSON list of ids or {"token_ids": [...], "request": {...}}')
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise RecipeError("token_ids must be integers")
    encoder = get_encoder(args.format, args.tokenizer)
    if encoder.tokenizer is None:
        raise RecipeError(f"format {args.format!r} has no tokenizer to decode with; pass --tokenizer")
    vocab_size = encoder.tokenizer.full.get_vocab_size(with_added_tokens=True)
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise RecipeError(f"token_ids[{index}] = {token_id} is outside the vocabulary (0..{vocab_size - 1})")
    # The request decides where parsing starts (thinking on/off, tools); default: a plain chat turn.
    conversation = parse_request(args.protocol, request) if request else parse_request(
        args.protocol, _minimal_request(args.protocol))
    session = OutputSession.for_encoding(encoder, encoder.encode(conversation), args.protocol, args.model)
    session.start()
    session.feed(ids)
    if not session.finished:
        session.finish("length")
    return session.final_response()


def _minimal_request(protocol: str) -> dict:
    if protocol == "responses":
        return {"input": ""}
    if protocol == "messages":
        return {"max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    return {"messages": [{"role": "user", "content": ""}]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # usage errors: argparse prints them and exits with 2
    try:
        data = json.loads(sys.stdin.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"deepinfer-recipe: stdin is not valid JSON: {exc}", file=sys.stderr)
        return 2
    try:
        result = _encode(args, data) if args.command == "encode" else _decode(args, data)
    except (RecipeError, OSError) as exc:  # RequestError is a RecipeError
        print(f"deepinfer-recipe: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. a tokenizer file `tokenizers` cannot read: still status 2
        print(f"deepinfer-recipe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
