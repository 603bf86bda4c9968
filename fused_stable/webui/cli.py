"""`fused-stable webui`: serve the page over one workspace folder.

    fused-stable webui                                    # http://127.0.0.1:7860, workspace runs/
    fused-stable webui --workspace exp --port 8000
    fused-stable webui --host 0.0.0.0 --auth me:secret    # reachable from other machines: only with --auth

Binding to anything but a loopback address without `--auth` is refused (one line, exit code 2): the page
starts processes and reads and writes the workspace. No gradio share link and no telemetry, ever.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from fused_stable.argcheck import OneLineParser, check_writable, number, parse_command
from fused_stable.cli import offline_environment
from fused_stable.errors import UserError

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_WORKSPACE = "127.0.0.1", 7860, "runs"
INSTALL_HINT = 'pip install -e ".[webui]"'


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="fused-stable webui", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, this machine only)")
    p.add_argument(
        "--port", type=number(1, 65535, integer=True), default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})"
    )
    p.add_argument(
        "--workspace",
        default=DEFAULT_WORKSPACE,
        help=f"the folder every run of the page lives under, created if missing (default: {DEFAULT_WORKSPACE}/)",
    )
    p.add_argument("--auth", default=None, help="USER:PASSWORD the page asks for (needed for a non-loopback --host)")
    return p


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and `localhost`: any other name may resolve to a reachable address."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_args(args) -> tuple[str, str] | None:
    """The (user, password) pair, or None; UserError for a public bind without it or a malformed --auth."""
    auth = None
    if args.auth is not None:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UserError("--auth must be USER:PASSWORD, both non-empty")
        auth = (user, password)
    if not is_loopback(args.host) and auth is None:
        raise UserError(
            f"--host {args.host} is not a loopback address: anyone who reaches it could start runs and read the "
            "workspace; give --auth USER:PASSWORD too (or bind 127.0.0.1)"
        )
    if not args.workspace.strip():
        raise UserError("--workspace is empty: give a folder")
    check_writable(args.workspace, "--workspace")
    return auth


def main(argv: list[str]) -> int:
    offline_environment()
    args, code = parse_command(build_parser(), argv, "webui")
    if args is None:
        return code
    try:
        auth = check_args(args)
        os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # no telemetry, no version check (before gradio loads)
        try:
            import gradio  # noqa: F401
        except ImportError:
            raise UserError(f"the page needs gradio: {INSTALL_HINT}") from None
        from fused_stable.webui.server import serve

        return serve(args.workspace, host=args.host, port=args.port, auth=auth)
    except UserError as exc:
        print(f"fused-stable webui: error: {exc}", file=sys.stderr)
        return 2
