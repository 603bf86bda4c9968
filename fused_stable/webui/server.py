"""Building and serving the page for one workspace: the controller of its runs, the chat / export helper, the
handlers and the gradio app, launched without a share link, telemetry, server-side rendering or MCP."""

from __future__ import annotations

import os
import sys
import time

from fused_stable.errors import UserError
from fused_stable.webui.paths import CONTROL_DIR, Workspace

GRADIO_CACHE = "gradio"  # WORKSPACE/.webui/gradio: gradio's own copies of uploads, inside the workspace too


def create_app(workspace_root: str, *, program: list[str] | None = None, tick_s: float | None = None):
    """(the gradio app, its `Page`) over the workspace (created if missing). `program`: what runs one run
    (see `RunController`)."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    workspace = Workspace(workspace_root)
    os.makedirs(workspace.control, exist_ok=True)
    # gradio keeps an upload in its cache folder before the page copies it into uploads/: keep that inside too
    os.environ["GRADIO_TEMP_DIR"] = os.path.join(workspace.root, CONTROL_DIR, GRADIO_CACHE)
    from fused_stable.webui.app import TICK_S, build_app
    from fused_stable.webui.controller import RunController
    from fused_stable.webui.finished import FinishedRuns
    from fused_stable.webui.page import Page

    page = Page(RunController(workspace, program), FinishedRuns(workspace))
    return build_app(page, tick_s or TICK_S), page


def launch(app, *, host: str, port: int | None, auth: tuple[str, str] | None) -> str:
    """Serve `app` in the background; returns its local URL."""
    try:
        _, url, _ = app.launch(
            server_name=host,
            server_port=port,
            auth=auth,
            share=False,
            prevent_thread_lock=True,
            quiet=True,
            ssr_mode=False,
            mcp_server=False,
            enable_monitoring=False,
            show_error=True,
        )
    except OSError as exc:  # the port is taken, or the address cannot be bound
        raise UserError(f"cannot serve on {host}:{port}: {str(exc).splitlines()[0]}") from None
    return url


def serve(workspace_root: str, *, host: str, port: int, auth: tuple[str, str] | None) -> int:
    app, page = create_app(workspace_root)
    launch(app, host=host, port=port, auth=auth)
    shown = f"[{host}]" if ":" in host else host
    print(
        f"fused-stable webui: http://{shown}:{port} over the workspace {page.workspace.root} "
        f"({'password required' if auth else 'this machine only'}); Ctrl-C stops the page, not its runs",
        flush=True,
    )
    try:
        while app.is_running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    app.close()
    print("fused-stable webui: stopped; runs started from it go on (a new webui finds them)", file=sys.stderr)
    return 0
