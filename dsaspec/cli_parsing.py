"""Command-line building blocks shared by ``dsaspec`` and its subcommands: a parser whose errors are
one line, argument types that validate (positive ints, comma-separated lists), help that shows every
default, and the note a CPU run prints about the options it does not use.

Lists are comma-separated everywhere (``--bs 1,4,16``); defaults are shown in that syntax.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterable

from dsaspec.errors import UserError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every option's help, lists comma-joined; options whose default
    is None or a store_true flag say their default in the help text instead."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: {format_value(default).replace('%', '%%')})"


_LEFT_BY = "_dsaspec_unrecognized_in"  # namespace attribute: prog of the innermost parser that left arguments


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UserError` (one line, no usage block) instead of
    printing usage and exiting, and takes options only by their full name (no prefixes);
    subparsers inherit the class, the help formatter and that rule. Unrecognized arguments point
    to the ``--help`` of the (sub)command that did not know them."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _LEFT_BY):  # a subcommand's parser returns first
            setattr(namespace, _LEFT_BY, self.prog)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            raise UserError(f"unrecognized arguments: {' '.join(extras)} "
                            f"(see {getattr(namespace, _LEFT_BY)} --help)")
        return namespace


def parse_or_exit(parser: Parser, args=None) -> argparse.Namespace:
    """``parser.parse_args(args)`` for a script's ``main``: a :class:`UserError` (a bad option) is
    printed as one line, ``<prog>: error: <message>``, and the process exits with status 2."""
    try:
        return parser.parse_args(args)
    except UserError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def format_value(value) -> str:
    """An option value as typed on the command line: lists comma-joined."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def option_name(dest: str) -> str:
    """``live_kv`` -> ``--live-kv``."""
    return "--" + dest.replace("_", "-")


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (``1,4,16``), at least one."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    try:
        return [positive_int(item) for item in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers (e.g. 1,4,16), got {text!r}") from None


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type factory: comma-separated names, each one of ``choices``, at least one."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {','.join(allowed)}, "
                                             f"got {text!r}")
        return items

    parse.__name__ = "choice_list"
    return parse


def check_at_most(values: Iterable[int], option: str, limit: int, limit_name: str) -> None:
    """Raise UserError naming ``option`` and its ``values`` above ``limit`` (``limit_name``, e.g.
    the option that sets it)."""
    too_big = [v for v in values if v > limit]
    if too_big:
        raise UserError(f"{option} {format_value(too_big)} exceeds {limit_name} {limit}")


def defaults_of(add_arguments: Callable[[argparse.ArgumentParser], None]) -> dict:
    """The default of every option that ``add_arguments`` defines, by dest."""
    parser = Parser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def use_cpu_sizes(args, add_arguments, sizes: dict, unused: Iterable[str] = ()) -> str | None:
    """Set ``args``' fields ``sizes`` (dest -> value) to a CPU run's fixed small sizes. Returns one
    line naming the options the user set (not at their defaults) that the run replaces (with the
    value it uses) or does not use (``unused`` dests); None if there are none."""
    defaults = defaults_of(add_arguments)
    notes = []
    for dest, value in sizes.items():
        given = getattr(args, dest)
        if given != defaults[dest] and given != value:
            notes.append(f"{option_name(dest)} {format_value(given)} (uses {format_value(value)})")
        setattr(args, dest, value)
    for dest in unused:
        given = getattr(args, dest)
        if given != defaults[dest]:
            notes.append(f"{option_name(dest)} {format_value(given)} (not used)")
    if not notes:
        return None
    return "Without CUDA this run uses fixed small sizes; of the options given it ignores: " + ", ".join(notes)
