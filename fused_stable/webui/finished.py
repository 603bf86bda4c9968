"""Chat with a finished run and export it, through the commands' own code: `fused-stable chat`'s loading and
answer (`train.chat.load_chat_model`, `answer`) and `fused-stable export`'s merge (`train.export.export`), so
the page answers and exports exactly as the commands do. Paths stay inside the workspace."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from fused_stable.errors import UserError
from fused_stable.webui.paths import Workspace
from fused_stable.webui.runs import final_artifact


class FinishedRuns:
    """Chat and export on the workspace's finished runs; the model of the last run chatted with stays loaded."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self._loaded: tuple | None = None  # (run_dir, model, tokenizer, the run's system message)
        self._mutex = threading.Lock()

    def finished_dir(self, run: str) -> str:
        run_dir = self.workspace.resolve(run, "run")
        if final_artifact(run_dir) is None:
            raise UserError(f"{run!r} has no final adapter or model yet: chat and export need a finished run")
        return run_dir

    def _model(self, run_dir: str):
        if self._loaded is None or self._loaded[0] != run_dir:
            from fused_stable.train.saved.chat import load_chat_model
            from fused_stable.train.saved.final_model import inspect_saved

            self._loaded = None  # the previous model goes before the next one loads
            args = SimpleNamespace(adapter=run_dir, saved=inspect_saved(run_dir))
            model, tokenizer, _ = load_chat_model(args, "cpu", log=lambda text: None)
            self._loaded = (run_dir, model, tokenizer, args.saved.system)
        return self._loaded[1:]

    def reply(self, run: str, messages: list[dict], max_new_tokens: int = 128) -> str:
        """The run's answer (greedy, as `fused-stable chat` gives it) to the conversation `messages`
        ([{"role", "content"}], the last one the user's), with the run's system message first unless the
        conversation has its own."""
        from fused_stable.train.data.rows import with_system
        from fused_stable.train.saved.chat import answer

        if not messages or messages[-1].get("role") != "user" or not str(messages[-1].get("content", "")).strip():
            raise UserError("write a message first")
        if not 1 <= int(max_new_tokens) <= 100_000:
            raise UserError(f"max_new_tokens must be in [1, 100000], got {max_new_tokens}")
        run_dir = self.finished_dir(run)
        with self._mutex:  # one generation at a time on the loaded model
            model, tokenizer, system = self._model(run_dir)
            clean = with_system([{"role": m["role"], "content": str(m["content"])} for m in messages], system)
            return answer(model, tokenizer, clean, max_new_tokens=int(max_new_tokens), stream=False)

    def export(self, run: str, target: str, overwrite: bool = False) -> dict:
        """`fused-stable export --adapter RUN --output_dir TARGET`, both inside the workspace."""
        from fused_stable.train.saved.export import export

        output_dir = self.workspace.resolve(target, "export folder")
        run_dir = self.finished_dir(run)
        result = export(run_dir, output_dir, overwrite=overwrite, log=lambda text: None)
        return {**result, "name": self.workspace.relative(output_dir)}
