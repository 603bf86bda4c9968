"""Command-line checking shared by every `fused-stable` command, so that they all behave alike on bad input.

- `--key_name` and `--key-name` are the same option everywhere (`flag_spelling`);
- an unknown option gets a "did you mean" only when a known name is close, or when it is a well-known alias
  from other tools (`suggestion`: `--learning_rate` -> `--lr`), never a far-fetched guess;
- numbers are checked where they are parsed: finite, and inside the range that makes sense (`number`);
- an output folder is checked writable before any work starts, without writing anything (`check_writable`);
- a `--device` is parsed in one place: auto, cpu, cuda or cuda:N that this machine has (`check_device`,
  `resolve_device`);
- a mistake is one line on stderr and exit code 2 (`OneLineParser`, `UserError`, `parse_command`), and help
  fits 100 columns.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Iterable

from fused_stable.errors import UserError

HELP_WIDTH = 100
# close-match threshold for "did you mean": 0.75 keeps typos (grad_acum -> grad_accum, max_len -> max_length)
# and drops look-alikes that are not the same thing (learning_rate vs logging_steps is 0.54)
CLOSE_MATCH = 0.75


def flag_spelling(token: str) -> str:
    """`--key_name[=v]` -> `--key-name[=v]`; other tokens unchanged."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token[2:].partition("=")
    return "--" + name.replace("_", "-") + eq + value


def suggestion(
    name: str, known: Iterable[str], aliases: dict[str, str] | None = None, cutoff: float = CLOSE_MATCH
) -> str | None:
    """The known name `name` probably meant (compared with dashes and underscores alike), or None. Short
    names (commands) need a lower `cutoff`: one wrong letter of three is a ratio of 0.67."""

    def canon(s: str) -> str:
        return s.lstrip("-").replace("-", "_").lower()

    by_canon = {canon(k): k for k in known}
    key = canon(name)
    for alias, target in (aliases or {}).items():
        if canon(alias) == key and canon(target) in by_canon:
            return by_canon[canon(target)]
    close = difflib.get_close_matches(key, list(by_canon), n=1, cutoff=cutoff)
    return by_canon[close[0]] if close else None


# ------------------------------------------------------------------------------------------ numbers
def parse_number(text, *, integer: bool) -> float | int:
    """A finite number from a flag string or a YAML value; ValueError (with the reason) if it is not one.
    Integers may be written as 1e3 or 1000.0, not as 2.5."""
    if isinstance(text, bool):
        raise ValueError("expected a number, got a boolean")
    try:
        value = float(text) if isinstance(text, str) else text
        if not isinstance(value, (int, float)):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text!r}")
    if integer:
        if value != int(value):
            raise ValueError(f"must be a whole number, got {text!r}")
        return int(value)
    return float(value)


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e16 else f"{bound:g}"


def check_range(value, low=None, high=None, *, low_open: bool = False, high_open: bool = False) -> str | None:
    """None if `value` lies in the range, else what is wrong ('must be positive', 'must be in [0, 1)', ...)."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return None
    if high is None:
        if low == 0:
            return "must be positive" if low_open else "must not be negative"
        return f"must be {'>' if low_open else '>='} {_show(low)}"
    if low is None:
        return f"must be {'<' if high_open else '<='} {_show(high)}"
    return f"must be in {'(' if low_open else '['}{_show(low)}, {_show(high)}{')' if high_open else ']'}"


def number(
    low=None, high=None, *, integer: bool = False, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float | int]:
    """An argparse `type=`: a finite number in the given range (ArgumentTypeError says why not)."""

    def parse(text: str):
        try:
            value = parse_number(text, integer=integer)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        problem = check_range(value, low, high, low_open=low_open, high_open=high_open)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    parse.__name__ = "integer" if integer else "number"  # what argparse names in its "invalid ... value"
    return parse


# ------------------------------------------------------------------------------------------ devices
_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def check_device(device: str, what: str = "device") -> None:
    """auto, cpu, cuda or cuda:N, and a CUDA device must exist on this machine (UserError otherwise). `what`:
    how the user named the option (`device` for the sft key, `--device` for a flag)."""
    match = _DEVICE.fullmatch(device)
    if not match:
        raise UserError(f"{what} must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{what}={device} but this machine has no CUDA device (use {what}=cpu or auto)")
        if match.group(1) is not None and int(match.group(1)) >= count:
            raise UserError(f"{what}={device} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}")


def resolve_device(device: str, what: str = "device"):
    """The torch.device for a `device` option (checked as in `check_device`): auto is cuda where this machine
    has CUDA, else the CPU."""
    check_device(device, what)
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ------------------------------------------------------------------------------------------ files
def check_writable(path: str, what: str) -> None:
    """Refuse (UserError) an output folder that cannot be created or written, without writing anything:
    the folder itself if it exists, else its nearest existing parent, must be a writable directory on a
    filesystem mounted read-write."""
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise UserError(f"{what} {path!r} exists and is not a directory")
    probe = target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f"{what} {path!r} cannot be created: {probe!r} is a file, not a directory")
    readonly = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    if readonly or not os.access(probe, os.W_OK | os.X_OK):
        reason = "is on a read-only filesystem" if readonly else "is not writable by this user"
        place = f"{path!r}" if probe == target else f"{path!r} cannot be created: {probe!r}"
        raise UserError(f"{what} {place} {reason}")


def check_file_name(name: str, what: str) -> None:
    """A bare file name (no folder part), as a file stem option needs."""
    if name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name) or "\0" in name:
        raise UserError(f"{what} must be a plain file name without folders, got {name!r}")


# ------------------------------------------------------------------------------------------ argparse
class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, width=HELP_WIDTH, max_help_position=30)


class OneLineParser(argparse.ArgumentParser):
    """argparse for `fused-stable COMMAND`: a mistake raises `UserError` (one line, with a "did you mean"
    for a close option name) instead of printing the usage and exiting; `--key_name` works for `--key-name`;
    no prefix abbreviations (a typo must not silently pick another option); help within 100 columns."""

    def __init__(self, *args, aliases: dict[str, str] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.aliases = aliases or {}

    def _option_names(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def parse_args(self, args=None, namespace=None):
        argv = [flag_spelling(a) for a in (args or [])]
        known = set(self._option_names())
        takes_value = {s for a in self._actions if a.nargs is None for s in a.option_strings}
        joined, i = [], 0
        while i < len(argv):
            token = argv[i]
            if token.startswith("--") and token != "--":
                name = token.split("=", 1)[0]
                if name not in known:
                    hint = suggestion(name, known, self.aliases)
                    tail = f"; did you mean {hint}?" if hint else f"; see `{self.prog} --help`"
                    raise UserError(f"unknown option {name}{tail}")
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if name == token and name in takes_value and nxt and nxt.startswith("-") and not nxt.startswith("--"):
                    # `--lr -inf`, `--lr -1e-3`: argparse would read a value like that as an option of its own
                    joined.append(f"{token}={nxt}")
                    i += 2
                    continue
            joined.append(token)
            i += 1
        return super().parse_args(joined, namespace)

    def error(self, message: str):
        # argparse's own wording, on one line: "argument --steps: invalid integer value: 'x'"
        raise UserError(re.sub(r"\s+", " ", message).strip())


def parse_command(parser: argparse.ArgumentParser, argv: list[str], command: str):
    """(args, None), or (None, exit code) when there is nothing to run: 0 after --help, 2 after a bad option
    (reported on one line on stderr as `fused-stable COMMAND: error: ...`)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:  # --help
        return None, int(exc.code or 0)
    except UserError as exc:
        print(f"fused-stable {command}: error: {exc}", file=sys.stderr)
        return None, 2
