"""One option, one name, across commands, and every --help showing defaults (issue 42 item 11);
the response's model is the first --served-model-name."""

from __future__ import annotations

import argparse

import pytest

from deepinfer.cli.flags import parse_cli
from deepinfer.cli.main import build_parser
from deepinfer.entrypoints.errors import APIError
from deepinfer.entrypoints.options import ServerOptions
from deepinfer.entrypoints.state import ServerState


def _commands(parser: argparse.ArgumentParser, path=()):
    """(command words, parser) of every command that takes options."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _options(parser: argparse.ArgumentParser):
    # (an option whose default is SUPPRESS is another spelling of one whose default is shown)
    return [a for a in parser._actions if a.option_strings and argparse.SUPPRESS not in (a.help, a.default)
            and not isinstance(a, (argparse._HelpAction, argparse._StoreFalseAction))]


def test_every_help_shows_every_options_default():
    missing = []
    for words, parser in _commands(build_parser()):
        formatter = parser.formatter_class(prog="x")
        for action in _options(parser):
            if "default" not in formatter._get_help_string(action).lower():
                missing.append(f"{' '.join(words)} {action.option_strings[0]}")
    assert not missing, missing
    text = build_parser()._subparsers._group_actions[0].choices["eval"]._subparsers._group_actions[0] \
        .choices["generate"].format_help()
    assert "(default: 8)" in text and "(default: 32)" in text


def _parse(*argv):
    return parse_cli(build_parser(), list(argv))


def test_the_server_url_and_model_name_have_one_name_everywhere():
    bench = _parse("bench", "serve", "--base-url", "http://h:1", "--served-model-name", "smol")
    assert (bench.base_url, bench.served_model_name) == ("http://h:1", "smol")
    for url, name in (("--base-url", "--served-model-name"), ("--model-url", "--served-model")):
        gen = _parse("eval", "generate", "--task", "mc_basics", "--out", "o", url, "http://h:1", name, "smol")
        assert (gen.base_url, gen.served_model_name) == ("http://h:1", ["smol"])
    assert _parse("eval", "generate", "--task", "t", "--out", "o", "--max-concurrency", "3").concurrency == 3
    assert _parse("serve", "--served-model-name", "a", "b").served_model_name == ["a", "b"]


class _Client:
    tokenizer = None


@pytest.mark.parametrize("asked", [None, "smol", "other"])
def test_a_response_carries_the_first_served_name(asked):
    state = ServerState(_Client(), ["smol", "other"], ServerOptions(served_model_name=("smol", "other")))
    assert state.check_model(asked) == "smol"
    with pytest.raises(APIError) as err:
        state.check_model("third")
    assert err.value.status == 404
