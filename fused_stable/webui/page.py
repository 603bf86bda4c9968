"""The page (gradio): set up a run, watch it live, stop / pause / resume it, browse the workspace's runs, chat
with and export a finished one; and the API endpoints scripts and tests call (`start_run`, `run_status`,
`stop_run`, `pause_run`, `resume_run`, `upload_dataset`, `chat`, `export_run`).

Every handler reads the run's own files again (a timer refreshes every `tick_s` seconds), so the page keeps
no state a browser refresh, a second tab or a restarted webui could lose. What each control does:
docs/webui.md.
"""

from __future__ import annotations

import html
import os
import shutil

import gradio as gr
import pandas as pd
import yaml

from fused_stable.errors import UserError
from fused_stable.train.run.report import METRICS_FILE
from fused_stable.webui import form
from fused_stable.webui.controller import BUILTIN_DATASETS, RunController, builtin_models
from fused_stable.webui.finished import FinishedRuns
from fused_stable.webui.paths import UPLOADS_DIR
from fused_stable.webui.runs import final_artifact, list_runs, read_rows, read_status
from fused_stable.webui.views import alerts_frame, eval_markdown, fmt, plot_frames, status_markdown

MODELS_DIR = "models"  # where the model field looks for local models (any workspace path is accepted)
RUN_COLUMNS = ["run", "state", "step", "loss", "alerts", "reason"]


def _error(exc: Exception) -> gr.Error:
    # the modal renders HTML: the message (which may quote user input) is shown as text
    return gr.Error(html.escape(str(exc), quote=False), print_exception=False)


class Page:
    """The handlers behind the page and its API, over one workspace's controller."""

    def __init__(self, controller: RunController, finished: FinishedRuns):
        self.controller, self.finished = controller, finished
        self.workspace = controller.workspace

    # -------------------------------------------------------------------------------- the API endpoints
    def start_run(self, config: str) -> dict:
        """Start a run: `config` is its sft keys as YAML text (as in an `sft --config` file). Returns the run's
        state (run_dir, state, step, max_steps, loss, grad_norm, alerts, ...)."""
        try:
            return self.controller.start(config).to_dict()
        except UserError as exc:
            raise _error(exc) from None

    def run_status(self, run: str = "") -> dict:
        """The state of `run` (its folder relative to the workspace; empty: the run started last)."""
        try:
            return self.controller.status(run).to_dict()
        except UserError as exc:
            raise _error(exc) from None

    def stop_run(self) -> dict:
        """Stop the running run: it finishes its step, saves a checkpoint and exits (as Ctrl-C)."""
        return self._act(self.controller.stop)

    def pause_run(self) -> dict:
        """Pause the running run: checkpoint and exit, waiting for resume_run."""
        return self._act(self.controller.pause)

    def resume_run(self, run: str = "") -> dict:
        """Continue a paused or stopped run (default: the run started last) from its checkpoint."""
        return self._act(lambda: self.controller.resume(run))

    def chat(self, run: str, message: str, max_new_tokens: int = 128) -> str:
        """One answer of a finished run to `message` (greedy, as `fused-stable chat --prompt`)."""
        try:
            return self.finished.reply(run, [{"role": "user", "content": message}], max_new_tokens)
        except UserError as exc:
            raise _error(exc) from None

    def export_run(self, run: str, target: str, overwrite: bool = False) -> dict:
        """Merge a finished run's adapter into a plain Hugging Face folder `target` (inside the workspace)."""
        try:
            return self.finished.export(run, target, overwrite)
        except UserError as exc:
            raise _error(exc) from None

    def _act(self, action) -> dict:
        try:
            return action().to_dict()
        except UserError as exc:
            raise _error(exc) from None

    # -------------------------------------------------------------------------------- page handlers
    def upload(self, path: str | None) -> tuple[str, str]:
        """Copy an uploaded dataset into uploads/ under its base name: (its name for the dataset field, a
        message). The API endpoint `upload_dataset`."""
        if not path:
            return "", "nothing uploaded"
        try:
            target = self.workspace.upload_target(os.path.basename(path))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
        except UserError as exc:
            raise _error(exc) from None
        name = self.workspace.relative(target)
        return name, f"uploaded `{name}`"

    def dataset_choices(self) -> list[str]:
        folder = os.path.join(self.workspace.root, UPLOADS_DIR)
        uploads = sorted(f"{UPLOADS_DIR}/{n}" for n in os.listdir(folder)) if os.path.isdir(folder) else []
        return [*BUILTIN_DATASETS, *uploads]

    def model_choices(self) -> list[str]:
        """The built-in models, then model folders and .gguf files under the workspace's models/."""
        folder = os.path.join(self.workspace.root, MODELS_DIR)
        local = (
            sorted(f"{MODELS_DIR}/{n}" for n in os.listdir(folder) if not n.startswith("."))
            if os.path.isdir(folder)
            else []
        )
        return [*builtin_models(), *local]

    def preview(self, *values) -> str:
        """The command line of the current form, or the one-line reason it would not start."""
        try:
            keys = form.run_keys(*self._form(values))
            return self.controller.prepare(keys).command
        except UserError as exc:
            return f"# not startable: {exc}"

    def start_from_form(self, *values) -> str:
        try:
            keys = form.run_keys(*self._form(values))
            status = self.controller.start(yaml.safe_dump(keys, sort_keys=False))
        except UserError as exc:
            return f"**not started:** {html.escape(str(exc))}"
        return f"started `{status.name}`"

    @staticmethod
    def _form(values) -> tuple[dict, str, str, str]:
        *fields, tuner, run_name, extra = values
        return dict(zip(form.FIELD_KEYS, fields)), tuner, run_name, extra

    def act_from_page(self, action: str, run: str = "") -> str:
        do = {
            "stop": self.controller.stop,
            "pause": self.controller.pause,
            "resume": lambda: self.controller.resume(run),
        }[action]
        try:
            status = do()
        except UserError as exc:
            return f"**{html.escape(str(exc))}**"
        return f"{action}: `{status.name}` is {status.state}" + (f" ({status.reason})" if status.reason else "")

    def view(self, run: str = ""):
        """The outputs of a run view: status, loss / grad-norm / lr plots, alerts, eval, Resume allowed."""
        try:
            s = self.controller.status(run)
        except UserError:
            s = None
        rows = read_rows(os.path.join(s.run_dir, METRICS_FILE)) if s is not None else []
        loss, norm, lr = plot_frames(rows, s.max_grad_norm if s else None)
        at = f", step {s.step}" if s is not None and rows else ""
        return (
            status_markdown(s),
            gr.update(value=loss, label=f"loss{at}"),
            gr.update(value=norm, label=f"pre-clip grad norm{at}"),
            gr.update(value=lr, label=f"learning rate{at}"),
            alerts_frame(s),
            eval_markdown(s),
            gr.update(interactive=bool(s and s.can_resume)),
        )

    def runs_table(self):
        table, names = [], []
        holder = self.controller.lock.holder()
        for run_dir in list_runs(self.workspace):
            s = read_status(self.workspace, run_dir, holder)
            names.append(s.name)
            table.append([s.name, s.state, f"{s.step}/{s.max_steps or '?'}", fmt(s.loss), len(s.alerts), s.reason])
        return pd.DataFrame(table, columns=RUN_COLUMNS), names

    def finished_names(self) -> list[str]:
        return [self.workspace.relative(d) for d in list_runs(self.workspace) if final_artifact(d)]
