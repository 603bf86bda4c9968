"""The one exception type for mistakes in the user's input: the CLI prints it as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """A bad config, flag, path or data file. The message is shown to the user as is, without a traceback."""
