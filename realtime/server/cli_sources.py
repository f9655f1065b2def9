"""Where a command's settings come from: its flags, `PARLEY_*` environment variables and an
optional TOML file (`--config parley.toml`). Precedence: flag, then environment, then file,
then the flag's default.

It works over argparse generically: every long option of the parser gets its environment
variable (`--max-sessions` -> `PARLEY_MAX_SESSIONS`) and its file key (`max_sessions`),
converted and checked by the option's own `type` and `choices`, so a flag added later needs
nothing here. Environment and file values become the parser's defaults and the command line
is parsed again, so a flag given on the command line always wins.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ENV_PREFIX = "PARLEY_"
CONFIG_FLAG = "--config"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The settable options by dest (not --help, --version or --config itself)."""
    skip = (argparse._HelpAction, argparse._VersionAction)
    return {a.dest: a for a in parser._actions
            if a.option_strings and not isinstance(a, skip) and a.dest != "config"}


def install(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and name each option's environment variable in its help."""
    parser.add_argument(CONFIG_FLAG, default=None, metavar="FILE",
                        help=f"TOML file of settings, keys = flag names with underscores (max_sessions = 4); "
                             f"also {env_name('config')}")
    for dest, action in _options(parser).items():
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {env_name(dest)}]".strip()
    note = (f"Every flag can also come from the environment ({ENV_PREFIX} + the flag name in capitals with "
            f"underscores, e.g. {env_name('max_sessions')}) or from a TOML file given with {CONFIG_FLAG} (keys = "
            f"flag names with underscores). Precedence: flag, then environment, then file, then default.")
    parser.epilog = f"{parser.epilog}\n\n{note}" if parser.epilog else note
    parser.set_defaults(_sources_installed=True)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    """A value from the environment (a string) or the file (TOML-typed), as the flag would give it."""
    if action.nargs == 0:  # store_true / store_false / store_const
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            value = value.lower() in _TRUE
        if not isinstance(value, bool):
            parser.error(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return value  # the setting's own value (PARLEY_NO_X=true sets no_x, whatever the flag's sense)
        return action.const if value else action.default
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and action.type is not None):
        parser.error(f"{where}: expected a single value, got {value!r}")
    text = str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{where}: invalid value {text!r} ({exc})")
    if action.choices is not None and converted not in action.choices:
        parser.error(f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _read_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        with Path(path).open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        parser.error(f"{CONFIG_FLAG} {path}: cannot read it ({exc.strerror})")
    except tomllib.TOMLDecodeError as exc:
        parser.error(f"{CONFIG_FLAG} {path}: not valid TOML ({exc})")


def source_values(parser: argparse.ArgumentParser, config_path: str | None,
                  environ: Mapping[str, str]) -> dict[str, Any]:
    """File values, overridden by environment values, converted by each option's own rules."""
    options = _options(parser)
    values: dict[str, Any] = {}
    path = config_path or environ.get(env_name("config"))
    if path:
        for key, value in _read_file(parser, path).items():
            action = options.get(key.replace("-", "_"))
            if action is None:  # a setting that would be ignored is an error, not a silent drop
                parser.error(f"{CONFIG_FLAG} {path}: unknown setting {key!r}; known: {', '.join(sorted(options))}")
            values[action.dest] = _convert(parser, action, value, f"{CONFIG_FLAG} {path}: {key}")
    for dest, action in options.items():
        name = env_name(dest)
        if name in environ:
            values[dest] = _convert(parser, action, environ[name], f"environment variable {name}")
    return values


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               environ: Mapping[str, str]) -> argparse.Namespace:
    """Parse `argv` with environment and file values as defaults for the chosen subcommand."""
    args = parser.parse_args(argv)
    if not getattr(args, "_sources_installed", False):
        return args
    command = _subparser(parser, args)
    values = source_values(command, getattr(args, "config", None), environ)
    if not values:
        return args
    command.set_defaults(**values)
    return parser.parse_args(argv)


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[args.command]
    return parser
