"""Path safety: every path the page reads or writes lies inside the workspace folder.

A path given through the page (a run's `output_dir`, a `dataset` or `model` file, an export target) is
relative to the workspace: absolute paths, `..` and names that start with a dot (the page's own `.webui/`
records, hidden files) are refused, and the resolved path, symbolic links followed, must still lie inside
the workspace. An uploaded file keeps only its base name and lands in `uploads/`.
"""

from __future__ import annotations

import os
import re

from fused_stable.errors import UserError

CONTROL_DIR = ".webui"  # the page's own records (lock, per-run process records, logs), never a run
UPLOADS_DIR = "uploads"


class Workspace:
    """The folder every run of the page lives under (`--workspace`, created if missing)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(os.path.abspath(os.path.expanduser(root)))

    @property
    def control(self) -> str:
        return os.path.join(self.root, CONTROL_DIR)

    def contains(self, path: str) -> bool:
        """Whether `path`, symbolic links resolved, is the workspace or lies inside it."""
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    def resolve(self, relative: str, what: str) -> str:
        """The absolute path of `relative` inside the workspace; UserError (one line) for anything that is
        absolute, climbs out with `..`, names a hidden entry, or resolves outside through a link."""
        text = str(relative).strip()
        if not text:
            raise UserError(f"{what} is empty: give a path inside the workspace")
        if os.path.isabs(text) or text.startswith("~"):
            raise UserError(
                f"{what} {relative!r} is an absolute path: give a path relative to the workspace {self.root}"
            )
        parts = [p for p in re.split(r"[\\/]+", text) if p not in ("", ".")]
        if ".." in parts:
            raise UserError(f"{what} {relative!r} climbs out with '..': give a path inside the workspace {self.root}")
        hidden = [p for p in parts if p.startswith(".")]
        if hidden or "\0" in text:
            raise UserError(f"{what} {relative!r} names a hidden entry ({hidden[0] if hidden else 'NUL'}): refused")
        if not parts:
            raise UserError(f"{what} {relative!r} is the workspace itself: give a folder or file inside it")
        path = os.path.join(self.root, *parts)
        if not self.contains(path):
            raise UserError(f"{what} {relative!r} leads outside the workspace {self.root} (a symbolic link)")
        return path

    def relative(self, path: str) -> str:
        """The workspace-relative spelling of a path inside it."""
        return os.path.relpath(os.path.realpath(path), self.root)

    def upload_target(self, filename: str) -> str:
        """Where an uploaded file goes: `uploads/<its base name>`; any folder part of the name is dropped."""
        base = re.split(r"[\\/]", str(filename))[-1].strip()
        if not base or base.startswith(".") or "\0" in base:
            raise UserError(f"upload name {filename!r} is not a usable file name")
        return self.resolve(f"{UPLOADS_DIR}/{base}", "upload")
