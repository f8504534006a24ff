"""`CliParser`: the argparse parser of every console script (rollout-worker, rollout-bench, rollout-eval,
rollout-keygen), so that each answers a mistake alike: one error line (a typo'd flag or choice with the closest one
suggested, a bad setting with the flag that gave it) and a hint to `--help`, never the whole usage first; and each
`--help` shows every flag's default.

Free of torch and of every rollout module but `validation` (a parser must build, and `--help` answer, at once).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import sys
from typing import Any, NoReturn

from rollout.validation import FieldError

__all__ = ["CliParser", "DefaultsHelpFormatter", "default_text", "shows_default"]

# A config field's name inside an error's text: lower-case words joined by underscores (max_memory_percent).
_FIELD_NAME = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")

# Other tools' names for torch dtypes (vLLM's --dtype half and float, the common short forms) -> torch's, for the
# suggestion a --dtype choice gets.
DTYPE_SPELLINGS = {
    **{name: "float16" for name in ("fp16", "half")},
    **{name: "bfloat16" for name in ("bf16", "bfloat")},
    **{name: "float32" for name in ("fp32", "float", "float64", "fp64", "double")},  # (no float64: the next best)
}


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (they hold examples and lists); each flag's help ends with "(default: X)".

    Left out where it would be noise or wrong: a help that already speaks of its default (it says more than the
    value: "default: 16 MiB", "default: the model's context"), flags that take no value (--insecure is off unless
    given), and a default of None or [] (unset: its help must say what unset means; `tests/test_cli_startup.py`
    checks that every such flag does).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not shows_default(action):
            return text
        # The help is %-formatted afterwards: a % in a default must stay literal.
        return f"{text} (default: {default_text(action.default).replace('%', '%%')})"


def _takes_several(action: argparse.Action) -> bool:
    """Whether a flag's value is a list: it takes several values, or is repeatable."""
    several = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    return several or isinstance(action, argparse._AppendAction)  # noqa: SLF001 - argparse has no public name


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` appends `action`'s default to its help (see `DefaultsHelpFormatter`).

    Args:
        action: a parser's action.
    """
    if action.help in (None, argparse.SUPPRESS) or "default" in action.help or action.nargs == 0:
        return False
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return False  # a required positional argument has no default
    return action.default not in (None, argparse.SUPPRESS, [])


def default_text(value: Any) -> str:
    """A default as a user would type it: a list space-separated (nargs="+"), a float without trailing zeros.

    Args:
        value: a flag's default.
    """
    if isinstance(value, (list, tuple)):
        return " ".join(default_text(item) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def installed_version() -> str:
    """rollout's version, as installed (its package metadata), or "unknown" when it runs from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout")
    except PackageNotFoundError:
        return "unknown"


class CliParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line and a hint, with suggestions, naming flags.

    Its subcommands' parsers (`add_subparsers().add_parser`) are CliParsers too, with the same help formatter.
    """

    def __init__(
        self,
        *args: Any,
        field_flags: dict[str, str] | None = None,
        other_tools_flags: dict[str, str] | None = None,
        **kwargs: Any,
    ):
        """Args:
        *args: as `argparse.ArgumentParser`.
        field_flags: the flag that sets each config field whose name does not turn into it by dashes (e.g.
            {"scheduler_type": "--scheduler"}), so that `flag_message` names it.
        other_tools_flags: flags of other tools a user may type here, each with what to use instead (e.g.
            {"--port": "--bind tcp://127.0.0.1:PORT"}): said in place of the closest spelling.
        **kwargs: as `argparse.ArgumentParser`; `formatter_class` defaults to `DefaultsHelpFormatter`.
        """
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.field_flags = dict(field_flags or {})
        self.other_tools_flags = dict(other_tools_flags or {})
        # repeatable flags' values read from the environment: the command line's, when it gives some, replace them
        self._environment_lists: dict[str, int] = {}
        self._warned: set[str] = set()  # warnings already said (checks may run twice: before and after imports)
        self._variables: dict[str, str] = {}  # each flag whose default an environment variable set -> the variable

    def add_version_flag(self) -> None:
        """`--version`: prints the command's name and rollout's version, then exits."""
        self.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As `argparse.ArgumentParser.parse_args`, but an unknown flag's error suggests the closest known one (the
        chosen subcommand's parser reports it: its flags are the likely ones, its `--help` the one to read)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.subcommand_parser(parsed)._report_unrecognized(extras)
        return parsed

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's; the arguments are kept, so that a missing required flag's error can name a typo'd one."""
        self._given = [str(arg) for arg in (sys.argv[1:] if args is None else args)]
        parsed, extras = super().parse_known_args(args, namespace)
        for dest, count in self._environment_lists.items():  # argparse appends to a copy of the default
            values = getattr(parsed, dest, None)
            if isinstance(values, list) and len(values) > count:
                setattr(parsed, dest, values[count:])
        return parsed, extras

    def typed(self, flag: str) -> bool:
        """Whether the last parsed command line gave `flag` (as `--flag VALUE` or `--flag=VALUE`, or an abbreviation
        argparse took for it: `--dev cpu` is --device), as opposed to its value coming from the default or a
        ROLLOUT_* variable.

        Args:
            flag: the flag's option string, e.g. "--device".
        """
        action = self._option_string_actions.get(flag)
        for arg in getattr(self, "_given", []):
            if arg == "--":
                return False  # what follows is positional
            name = arg.split("=", 1)[0]
            if name == flag:
                return True
            # An unambiguous prefix of a long option is that option (argparse's allow_abbrev; an ambiguous one is
            # a usage error before this runs).
            if (
                action is not None
                and self.allow_abbrev
                and name.startswith("--")
                and len(name) > 2
                and name not in self._option_string_actions
            ):
                actions = {self._option_string_actions[o] for o in self._option_string_actions if o.startswith(name)}
                if actions == {action}:
                    return True
        return False

    def warn(self, message: str) -> None:
        """Print "PROG: warning: MESSAGE" to stderr, once per message for this parser.

        Args:
            message: what to say.
        """
        if message not in self._warned:
            self._warned.add(message)
            print(f"{self.prog}: warning: {message}", file=sys.stderr)

    def error(self, message: str) -> NoReturn:
        """Print "PROG: error: MESSAGE" and a line pointing at --help to stderr, exit with status 2 (as argparse
        does, without its usage summary: thirty lines of flags would bury the one that matters). When required
        flags are missing because one was mistyped (`--modle`), the closest known flag is suggested too."""
        if message.startswith("the following arguments are required"):
            message += self._typo_hint(getattr(self, "_given", []))
        message = self._name_variable(message)
        self.exit(2, f"{self.prog}: error: {message}\nTry '{self.prog} --help' for every flag and its default.\n")

    def _name_variable(self, message: str) -> str:
        """Each flag a message names whose value came from its environment variable (not typed) is named with the
        variable, as the user set that ("ROLLOUT_METRICS_HOST (--metrics-host) ..."), unless the message names it."""
        named: set[str] = set()

        def with_variable(match: re.Match) -> str:
            flag = match.group()
            variable = self._variables.get(flag)
            if variable is None or flag in named or variable in message or self.typed(flag):
                return flag
            named.add(flag)
            return f"{variable} ({flag})"

        return re.sub(r"--[\w-]+", with_variable, message)

    def _typo_hint(self, given: list[str]) -> str:
        """ "; did you mean X (for Y)?" for the given flags this parser does not know, where a known one is close."""
        guesses = []
        for flag in (arg.split("=", 1)[0] for arg in given if arg.startswith("--")):
            if flag not in self._option_string_actions:
                close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1)
                guesses += [f"{close[0]} (for {flag})"] if close else []
        return f"; did you mean {', '.join(guesses)}?" if guesses else ""

    def defaults_from_environment(self, prefix: str) -> None:
        """Let an environment variable PREFIX<DEST> (upper case, e.g. ROLLOUT_MAX_BATCH_TOKENS) set each flag's
        default; a flag given on the command line still wins, and `--help` shows the default the variable set. A
        value the flag cannot take is a usage error naming the variable; a flag that takes no value reads
        1/true/yes or 0/false/no (or empty).

        A flag that takes several values (`nargs="+"`, or repeatable) reads them as a shell splits words:
        ROLLOUT_LORA='a=/p b=/q' serves two adapters, and a value with spaces is quoted.

        Args:
            prefix: the variables' common start, e.g. "ROLLOUT_".
        """
        read = {prefix + action.dest.upper() for action in self._actions if action.option_strings}
        for variable in sorted(name for name in os.environ if name.startswith(prefix) and name not in read):
            close = difflib.get_close_matches(variable, sorted(read), n=1, cutoff=0.85)
            if close:  # a near miss (ROLLOUT_NUM_BLOCK): said, not ignored; others may be another program's
                print(
                    f"{self.prog}: warning: {variable} is set but no flag reads it; did you mean {close[0]}?",
                    file=sys.stderr,
                )
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            variable = prefix + action.dest.upper()
            value = os.environ.get(variable)
            if value is None:
                continue
            self._variables.update(dict.fromkeys(action.option_strings, variable))
            if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001 - argparse has no public name
                if value.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                    self.error(f"{variable}={value!r} is not a valid value for {action.option_strings[0]}")
                action.default = value.lower() in ("1", "true", "yes")
                continue
            if _takes_several(action):  # words as a shell splits them, each a value of the flag
                try:
                    words = shlex.split(value)
                except ValueError as error:
                    self.error(f"{variable}={value!r}: {error} (its values are split as a shell splits words)")
                if not words and action.nargs == "+":
                    self.error(f"{variable} is empty: {action.option_strings[0]} needs at least one value")
                action.default = [self._environment_value(action, variable, word) for word in words]
                if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - argparse has no public name
                    self._environment_lists[action.dest] = len(action.default)
            else:
                action.default = self._environment_value(action, variable, value)

    def _environment_value(self, action: argparse.Action, variable: str, value: str) -> Any:
        """One value of `action` read from the environment variable `variable`: converted by the flag's type and
        checked against its choices, else a usage error naming the variable."""
        try:
            converted = action.type(value) if action.type else value
        except (ValueError, argparse.ArgumentTypeError):
            self.error(f"{variable}={value!r} is not a valid value for {action.option_strings[0]}")
        if action.choices is not None and converted not in action.choices:
            names = [str(choice) for choice in action.choices]
            close = difflib.get_close_matches(str(converted), names, n=1) or [
                name for name in names if name.lower() == str(converted).lower()
            ]
            hint = f"; did you mean {close[0]}?" if close else ""
            self.error(
                f"{variable}={value!r} is not a valid value for {action.option_strings[0]} "
                f"(choose from {', '.join(names)}){hint}"
            )
        return converted

    def flag_message(self, error: ValueError) -> str:
        """The text of a usage error for `error`: a `FieldError` names the flag of its field (and any other field
        its reason mentions) where this parser has one, so the user reads what they typed; others as they are.

        Args:
            error: raised while building a config from the parsed flags.
        """
        if not isinstance(error, FieldError):
            return str(error)
        flag = self.flag_for(error.field)
        reason = _FIELD_NAME.sub(lambda match: self.flag_for(match.group()) or match.group(), error.reason)
        return f"{flag or error.field}: {reason}"

    def flag_for(self, field: str) -> str | None:
        """The flag that sets the config field `field` (its name with dashes, or `field_flags`'), None if none does.

        Args:
            field: a config field's name, e.g. "max_memory_percent".
        """
        flag = self.field_flags.get(field, "--" + field.replace("_", "-"))
        return flag if flag in self._option_string_actions else None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """As argparse's, with the closest choice suggested (a subcommand's name too)."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            names = [str(choice) for choice in action.choices or ()]
            close = [name for name in names if name == DTYPE_SPELLINGS.get(str(value).lower())]
            close = close or difflib.get_close_matches(str(value), names, n=1)
            close = close or [name for name in names if name.lower() == str(value).lower()]  # "info" for INFO
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{error.message}; did you mean {close[0]}?") from None

    def subcommand_parser(self, parsed: argparse.Namespace) -> CliParser:
        """The parser of the subcommand `parsed` chose (itself when it has none, or none was chosen): the one whose
        `error` names the subcommand's `--help`.

        Args:
            parsed: what `parse_args` returned.
        """
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 - argparse has no public name for it
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, CliParser):
                    return chosen.subcommand_parser(parsed)
        return self

    def _report_unrecognized(self, extras: list[str]) -> NoReturn:
        """A usage error for arguments nobody took: the unknown flags, each with the closest known flag if any."""
        flags = [arg for arg in extras if arg.startswith("-") and arg != "-"]
        shown = flags or extras  # the values after an unknown flag are left over too: the flag is the news
        message = f"unrecognized argument{'s' if len(shown) > 1 else ''} {' '.join(shown)}"
        guesses = []
        for flag in flags:
            name = flag.split("=", 1)[0]
            close = [self.other_tools_flags[name]] if name in self.other_tools_flags else []
            close = close or difflib.get_close_matches(name, list(self._option_string_actions), n=1)
            if close:
                guesses.append(close[0] if len(flags) == 1 else f"{close[0]} (for {flag})")
        self.error(message + (f"; did you mean {', '.join(guesses)}?" if guesses else ""))
