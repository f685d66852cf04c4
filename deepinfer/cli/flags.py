"""Command-line flags generated from a config dataclass: one flag per field, typed by the field.

    add_dataclass_flags(parser, CacheConfig)      # --block-size INT, --enable-prefix-caching, ...
    args = parse_cli(parser, argv)
    CacheConfig(**dataclass_values(CacheConfig, args))

The flag of field `foo_bar` is `--foo-bar`; its type is the field's annotation (typing.get_type_hints,
so `from __future__ import annotations` is fine):

    int / float / str         a value of that type
    X | None, Optional[X]     a value of X, or `None` to unset it (vLLM's convention)
    tuple[X, ...], list[X]    one or more values (`--served-model-name a b`)
    bool, bool | None         `--flag` (true), `--no-flag` (false), or an explicit
                              `--flag true|false|1|0|yes|no` / `--flag=VALUE` (vLLM launch lines
                              write `--enable-prefix-caching False`)

The help text is the string literal written under the field (an attribute docstring, as vLLM's
configs have), followed by the default. A field of any other type is a TypeError when the parser
is built, so a new field cannot silently become a string flag.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Sequence
from typing import Any

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    """argparse `type` of boolean flags: true/false, 1/0, yes/no, in any case."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false, 1/0, yes/no), got {text!r}")


class BooleanFlag(argparse.Action):
    """`--flag` stores True; `--flag=VALUE` stores parse_bool(VALUE), negated when `invert`
    (for an opposite-sense alias such as vLLM's `--disable-log-requests`).

    nargs="?" is what lets `--flag=VALUE` through argparse; parse_cli rewrites a bare `--flag`
    to `--flag=true` first, so that the optional value never swallows a following positional."""

    def __init__(self, option_strings, dest, invert: bool = False, **kwargs) -> None:
        self.invert = invert
        super().__init__(option_strings, dest, nargs="?", const=True, type=parse_bool, metavar="BOOL", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (not values) if self.invert else values)


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, klass: type, *,
                        skip: Sequence[str] = (), aliases: dict[str, Sequence[str]] | None = None,
                        choices: dict[str, Sequence[Any]] | None = None,
                        types: dict[str, Any] | None = None) -> list[str]:
    """Add one flag per field of `klass` (but those in `skip`); returns the fields added.

    aliases: extra option strings of a field's flag (e.g. {"tensor_parallel_size": ["-tp"]}).
    choices: the values a field's flag accepts; anything else is an argparse error listing them.
    types: a parser of a field's value other than its annotation's (e.g. `4k` for an int).
    """
    aliases, choices, types = aliases or {}, choices or {}, types or {}
    hints = typing.get_type_hints(klass)
    docs = field_docs(klass)
    added = []
    for f in dataclasses.fields(klass):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        option_strings = [flag_name(f.name), *aliases.get(f.name, ())]
        # argparse %-formats help strings, so a literal % must be doubled.
        help_text = f"{docs.get(f.name, '')} (default: {_show_default(default)})".strip().replace("%", "%%")
        kind, optional, many = _unwrap(hints[f.name], klass, f.name)
        if kind is bool and not many:
            parser.add_argument(*option_strings, action=BooleanFlag, dest=f.name, default=default, help=help_text)
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                help=f"the same as {flag_name(f.name)} false")
        else:
            value_type = types.get(f.name) or (_optional_of(kind) if optional else kind)
            parser.add_argument(*option_strings, dest=f.name, type=value_type, default=default,
                                nargs="+" if many else None, choices=choices.get(f.name),
                                metavar=_metavar(kind, choices.get(f.name)), help=help_text)
        added.append(f.name)
    return added


def dataclass_values(klass: type, args: argparse.Namespace, *, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed values of `klass`'s flags, as its constructor wants them (tuples for tuple fields)."""
    hints = typing.get_type_hints(klass)
    values = {}
    for f in dataclasses.fields(klass):
        if f.name in skip or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, list) and _unwrap(hints[f.name], klass, f.name)[2]:
            value = tuple(value)
        values[f.name] = value
    return values


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless its text already names one (the
    generated flags' do): `--flag` switches say "off", unset values "unset"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _shows_default(action) or "default" in text.lower():
            return text
        return f"{text} {_default_note(action)}".strip()


def _shows_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default is not argparse.SUPPRESS and not isinstance(
        action, (argparse._HelpAction, argparse._VersionAction, argparse._StoreFalseAction))


def _default_note(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        shown = "on" if action.default else "off"
    elif isinstance(action.default, (list, tuple)):
        shown = " ".join(map(str, action.default)) or "none"
    else:
        shown = _show_default(action.default)
    return f"(default: {shown.replace('%', '%%')})"


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """DefaultsHelpFormatter for `parser` and every sub-command under it (an option without help
    text gets its default as its text: argparse prints no help line for it otherwise)."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:   # argparse offers no public walk over its actions
        if action.help is None and _shows_default(action):
            action.help = _default_note(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)


def parse_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parser.parse_args(argv), with a --config file's values as the defaults (apply_config_file)
    and the boolean flags' values written explicitly first."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = apply_config_file(parser, explicit_booleans(argv, _boolean_options(parser)))
    return parser.parse_args(argv)


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of flag names (max_model_len or max-model-len) to
    values, for the command that takes --config (serve). The file's values become that command's
    defaults, so the command line wins; an unknown key or a bad value is an argparse error naming
    it. Returns argv without the --config option."""
    end = argv.index("--") if "--" in argv else len(argv)
    at = next((i for i, token in enumerate(argv[:end]) if token == "--config" or token.startswith("--config=")), None)
    if at is None:
        return argv
    command = parser
    for token in argv[:at]:   # the sub-command the option belongs to
        sub = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or token not in sub.choices:
            break
        command = sub.choices[token]
    if "--config" not in command._option_string_actions:
        return argv   # argparse names it as unrecognized
    if argv[at] == "--config":
        if at + 1 >= end:
            command.error("argument --config: expected one argument")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    for key, value in _read_config_file(command, path).items():
        action = command._option_string_actions.get("--" + str(key).replace("_", "-"))
        if action is None or action.dest in ("help", "config"):
            command.error(f"--config {path}: {key!r} is not a flag of this command")
        try:
            command.set_defaults(**{action.dest: _config_value(action, value)})
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            command.error(f"--config {path}: {key}: {e}")
    return rest


def _read_config_file(command: argparse.ArgumentParser, path: str) -> dict:
    try:
        import yaml
    except ImportError:
        command.error("--config needs PyYAML to read its file (a dependency of deepinfer): pip install pyyaml")
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        command.error(f"--config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        command.error(f"--config {path}: not valid YAML ({e})")
    if values is None:
        return {}
    if not isinstance(values, dict):
        command.error(f"--config {path}: the file must be a mapping of flag names to values")
    return values


def _config_value(action: argparse.Action, value: Any) -> Any:
    """A --config file's value as the action's parsed value."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        on = value if isinstance(value, bool) else parse_bool(str(value))
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, BooleanFlag):
        on = value if isinstance(value, bool) else parse_bool(str(value))
        return (not on) if action.invert else on
    convert = action.type or str

    def one(item: Any) -> Any:
        text = json.dumps(item) if isinstance(item, (dict, list)) else str(item)
        parsed = convert(text)
        if action.choices is not None and parsed not in action.choices:
            raise ValueError(f"{item!r} is not one of {', '.join(map(str, action.choices))}")
        return parsed

    if action.nargs in ("+", "*"):
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    return one(value)


def explicit_booleans(argv: list[str], boolean_options: set[str]) -> list[str]:
    """Rewrite `--flag` to `--flag=true` and `--flag VALUE` to `--flag=VALUE` for the boolean
    flags, where VALUE is one of the boolean words; any other next word stays an argument of its
    own (`deepinfer generate --enforce-eager "hello"` keeps its prompt). `--a_b` is read as
    `--a-b`, as vLLM does. Nothing after `--` is touched."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out.extend(argv[i:])
            break
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            name = name.replace("_", "-")
            token = name + eq + value
            if name in boolean_options and not eq:
                following = argv[i + 1] if i + 1 < len(argv) else None
                if following is not None and following.strip().lower() in (*TRUE_WORDS, *FALSE_WORDS):
                    token, i = f"{name}={following}", i + 1
                else:
                    token = f"{name}=true"
        out.append(token)
        i += 1
    return out


def field_docs(klass: type) -> dict[str, str]:
    """{field: the string literal written right under it in the class body}, one line each.
    Empty when the source is unavailable (a frozen executable): flags then have no help text."""
    docs: dict[str, str] = {}
    for base in reversed(klass.__mro__):
        if not dataclasses.is_dataclass(base):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


# ------------------------------------------------------------------------------------ internals
def _unwrap(hint: Any, klass: type, name: str) -> tuple[type, bool, bool]:
    """(element type, None allowed, several values) of a field annotation."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        if len(members) != 1:
            raise TypeError(f"{klass.__name__}.{name}: no flag type for the union {hint}")
        hint = members[0]
    many = False
    if typing.get_origin(hint) in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if len(set(args)) != 1:
            raise TypeError(f"{klass.__name__}.{name}: only tuple[X, ...] / list[X] become flags, not {hint}")
        hint, many = args[0], True
    if hint not in (bool, int, float, str) or (hint is bool and many):
        raise TypeError(f"{klass.__name__}.{name}: no flag type for {hint}")
    return hint, optional, many


def _optional_of(kind: type):
    def parse(text: str):
        return None if text in ("None", "none") else kind(text)

    parse.__name__ = kind.__name__   # argparse names the type in "invalid int value: 'x'"
    return parse


def _metavar(kind: type, choices: Sequence[Any] | None) -> str | None:
    if choices is not None:
        return "{" + ",".join(map(str, choices)) + "}"
    return {int: "INT", float: "FLOAT", str: None}[kind]


def _show_default(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, tuple):
        return " ".join(map(str, default)) or "none"
    return str(default)


def _boolean_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of every BooleanFlag in `parser` and its sub-commands."""
    found: set[str] = set()
    for action in parser._actions:   # argparse offers no public walk over its actions
        if isinstance(action, BooleanFlag):
            found.update(s for s in action.option_strings if s.startswith("--"))
        elif isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _boolean_options(sub)
    return found
