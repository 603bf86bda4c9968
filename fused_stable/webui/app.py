"""The page's layout and wiring (gradio Blocks): the Train tab (set-up form, safe defaults, the command line,
Start, and the live view of the run started last with Stop / Pause / Resume), the Runs tab (every run of the
workspace: its curves, alerts and before/after evaluation), Chat and Export; and the API endpoints.
Handlers are `page.Page`'s; elem_ids name what docs/webui.md and the browser test refer to."""

from __future__ import annotations

import html
from types import SimpleNamespace

import gradio as gr

from fused_stable.errors import UserError
from fused_stable.webui import form
from fused_stable.webui.page import Page

TICK_S = 2.0  # how often the live views read the run's files again


def _run_view(prefix: str):
    """A run's status, plots (loss, pre-clip grad norm with the clip line, lr), alerts and evaluation."""
    status = gr.Markdown(elem_id=f"{prefix}_status")
    with gr.Row():
        loss = gr.LinePlot(x="step", y="value", color="series", label="loss", elem_id=f"{prefix}_loss_plot")
        norm = gr.LinePlot(
            x="step", y="value", color="series", label="pre-clip grad norm", elem_id=f"{prefix}_grad_norm_plot"
        )
        lr = gr.LinePlot(x="step", y="value", color="series", label="learning rate", elem_id=f"{prefix}_lr_plot")
    with gr.Row():
        alerts = gr.Dataframe(label="alerts (kind, step, value, threshold, action taken)", interactive=False)
        evaluation = gr.Markdown(elem_id=f"{prefix}_eval")
    return status, loss, norm, lr, alerts, evaluation


def _setup_form(page: Page):
    """The set-up fields, in the order of form.FIELD_KEYS, then tuner, run name and the YAML box."""
    d = form.default
    with gr.Row():
        preset = gr.Radio(list(form.PRESETS), label="start from", value=None, elem_id="preset")
    with gr.Row():
        model = gr.Dropdown(page.model_choices(), value=d("model"), label="model", allow_custom_value=True)
        dataset = gr.Dropdown(
            page.dataset_choices(), value=d("dataset"), label="dataset (several: a,b)", allow_custom_value=True
        )
        upload = gr.UploadButton("upload a dataset (.json / .jsonl)", file_types=[".json", ".jsonl"])
        run_name = gr.Textbox(label="run folder (in the workspace; empty: run-<time>)", elem_id="run_name")
    with gr.Row():
        tuner = gr.Radio(list(form.TUNERS), value="LoRA", label="tuner")
        precision = gr.Dropdown(["auto", "bf16", "fp16", "fp32"], value=d("precision"), label="precision")
        guard = gr.Dropdown(["warn", "skip", "stop", "rollback"], value=d("guard"), label="guard policy")
        optim = gr.Dropdown(
            list(form.OPTIMIZER_CHOICES["optim"]), value=d("optim"), label="optimizer (lion: the default lr / 3)"
        )
        state_precision = gr.Dropdown(
            list(form.OPTIMIZER_CHOICES["state_precision"]), value=d("state_precision"), label="optimizer state"
        )
    with gr.Row():
        batch_size = gr.Number(d("batch_size"), label="batch size", precision=0)
        grad_accum = gr.Number(d("grad_accum"), label="grad accumulation", precision=0)
        max_steps = gr.Number(0, label="max steps (0: from epochs)", precision=0, elem_id="max_steps")
        epochs = gr.Number(d("epochs"), label="epochs")
        lr = gr.Number(d("lr"), label="learning rate")
    with gr.Row():
        lora_r = gr.Number(d("lora_r"), label="LoRA rank", precision=0)
        lora_alpha = gr.Number(d("lora_alpha"), label="LoRA alpha")
        max_grad_norm = gr.Number(d("max_grad_norm"), label="clip (max_grad_norm)")
        warmup_ratio = gr.Number(d("warmup_ratio"), label="warm-up ratio")
        scheduler = gr.Dropdown(["cosine", "linear", "constant"], value=d("scheduler"), label="lr schedule")
        weight_decay = gr.Number(d("weight_decay"), label="weight decay")
    with gr.Accordion("every other sft key (YAML, over the fields above)", open=False):
        extra = gr.Code(language="yaml", label="keys", lines=4, elem_id="extra_yaml")
    fields = [
        model,
        dataset,
        precision,
        guard,
        optim,
        state_precision,
        batch_size,
        grad_accum,
        max_steps,
        epochs,
        lr,
        lora_r,
        lora_alpha,
        max_grad_norm,
        warmup_ratio,
        scheduler,
        weight_decay,
    ]
    named = dict(zip(form.FIELD_KEYS, fields))
    return preset, named, [*fields, tuner, run_name, extra], upload


def build_app(page: Page, tick_s: float = TICK_S) -> gr.Blocks:
    """The page: its four tabs laid out, then their events wired (in this order, which fixes the events' order in
    gradio's config), then the API endpoints."""
    with gr.Blocks(title="fused-stable webui", analytics_enabled=False) as app:
        gr.Markdown(f"## fused-stable webui\nworkspace `{page.workspace.root}`: every run lives there")
        train = _train_tab(page)
        runs = _runs_tab()
        chat, export = _chat_tab(), _export_tab()
        _wire_form(app, page, train)
        timer = _wire_live_view(app, page, train, tick_s)
        _wire_runs(page, runs, timer)
        _wire_chat_and_export(page, chat, export)
        for fn in (page.start_run, page.run_status, page.stop_run, page.pause_run, page.resume_run):
            gr.api(fn, api_name=fn.__name__)
        gr.api(page.chat, api_name="chat")
        gr.api(page.export_run, api_name="export_run")
    return app


_PRIVATE = {"api_visibility": "private"}  # page events, not API endpoints


def _train_tab(page: Page) -> SimpleNamespace:
    """The Train tab: set-up form, safe defaults, the command line, Start, and the live view with its controls."""
    with gr.Tab("Train"):
        preset, named, inputs, upload = _setup_form(page)
        with gr.Row():
            safe = gr.Button("safe defaults", elem_id="safe_defaults")
            start = gr.Button("Start", variant="primary", elem_id="start")
        safe_info = gr.Markdown(elem_id="safe_info")
        command = gr.Code(
            language="shell", label="the same run on the command line", interactive=False, elem_id="command"
        )
        message = gr.Markdown(elem_id="message")
        with gr.Row():
            stop = gr.Button("Stop", elem_id="stop", variant="stop")
            pause = gr.Button("Pause", elem_id="pause")
            resume = gr.Button("Resume", elem_id="resume", interactive=False)
        live = _run_view("live")
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "page"})


def _runs_tab() -> SimpleNamespace:
    """The Runs tab: every run of the workspace, one of them shown with the live view's panels."""
    with gr.Tab("Runs") as tab:
        with gr.Row():
            chosen = gr.Dropdown([], label="run", allow_custom_value=False, elem_id="runs_choice")
            refresh = gr.Button("refresh")
            resume_chosen = gr.Button("Resume this run", interactive=False)
        table = gr.Dataframe(label="runs in the workspace", interactive=False)
        message = gr.Markdown()
        view = _run_view("chosen")
    return SimpleNamespace(**locals())


def _chat_tab() -> SimpleNamespace:
    with gr.Tab("Chat") as tab:
        run = gr.Dropdown([], label="finished run")
        bot = gr.Chatbot(label="chat (greedy, as fused-stable chat)")
        with gr.Row():
            said = gr.Textbox(label="message", scale=4)
            send = gr.Button("send")
            clear = gr.Button("clear")
    return SimpleNamespace(**locals())


def _export_tab() -> SimpleNamespace:
    with gr.Tab("Export") as tab:
        run = gr.Dropdown([], label="finished run")
        target = gr.Textbox(label="export folder (in the workspace)")
        overwrite = gr.Checkbox(label="replace a previous export there")
        do_export = gr.Button("Export")
        exported = gr.Markdown()
    return SimpleNamespace(**locals())


def _wire_form(app: gr.Blocks, page: Page, train: SimpleNamespace) -> None:
    """The form: presets, safe defaults, the command line, the upload, Start."""
    named, inputs = train.named, train.inputs
    train.preset.change(_preset_values(named), train.preset, [*named.values(), inputs[-1]], **_PRIVATE)
    train.safe.click(_safe_values, None, [*[named[k] for k in form.SAFE_DEFAULTS], train.safe_info], **_PRIVATE)
    gr.on([c.change for c in inputs], page.preview, inputs, train.command, **_PRIVATE)
    app.load(page.preview, inputs, train.command, **_PRIVATE)
    train.upload.upload(page.upload, train.upload, [named["dataset"], train.message], api_name="upload_dataset").then(
        lambda name: gr.update(choices=page.dataset_choices(), value=name),
        named["dataset"],
        named["dataset"],
        **_PRIVATE,
    )
    train.start.click(page.start_from_form, inputs, train.message, **_PRIVATE)


def _wire_live_view(app: gr.Blocks, page: Page, train: SimpleNamespace, tick_s: float) -> gr.Timer:
    """The live view of the run started last, and its controls; returns the timer that refreshes the views."""
    live_outputs = [*train.live, train.resume]
    train.stop.click(lambda: page.act_from_page("stop"), None, train.message, **_PRIVATE)
    train.pause.click(lambda: page.act_from_page("pause"), None, train.message, **_PRIVATE)
    train.resume.click(lambda: page.act_from_page("resume"), None, train.message, **_PRIVATE)
    timer = gr.Timer(tick_s)
    timer.tick(page.view, None, live_outputs, **_PRIVATE)
    app.load(page.view, None, live_outputs, **_PRIVATE)
    return timer


def _wire_runs(page: Page, runs: SimpleNamespace, timer: gr.Timer) -> None:
    """Every run of the workspace: the table, the chosen run's view (refreshed by the timer), its Resume."""
    chosen_outputs = [*runs.view, runs.resume_chosen]

    def list_runs(current):
        frame, names = page.runs_table()
        keep = current if current in names else (names[0] if names else None)
        return frame, gr.update(choices=names, value=keep)

    for event in (runs.tab.select, runs.refresh.click):
        event(list_runs, runs.chosen, [runs.table, runs.chosen], **_PRIVATE)
    runs.chosen.change(page.view, runs.chosen, chosen_outputs, **_PRIVATE)
    timer.tick(lambda run: page.view(run) if run else page.view(), runs.chosen, chosen_outputs, **_PRIVATE)
    runs.resume_chosen.click(lambda run: page.act_from_page("resume", run), runs.chosen, runs.message, **_PRIVATE)


def _wire_chat_and_export(page: Page, chat: SimpleNamespace, export: SimpleNamespace) -> None:
    for tab, box in ((chat.tab, chat.run), (export.tab, export.run)):
        tab.select(lambda: gr.update(choices=page.finished_names()), None, box, **_PRIVATE)
    chat.send.click(chat_turn(page), [chat.run, chat.bot, chat.said], [chat.bot, chat.said], **_PRIVATE)
    chat.clear.click(lambda: ([], ""), None, [chat.bot, chat.said], **_PRIVATE)
    export.do_export.click(_export(page), [export.run, export.target, export.overwrite], export.exported, **_PRIVATE)


def _preset_values(named: dict):
    def fill(choice):
        keys, extra = form.PRESETS.get(choice, ({}, ""))
        values = [keys.get(k, form.default(k) if k != "max_steps" else 0) for k in named]
        return [*values, extra]

    return fill


def _safe_values():
    """The safe defaults, in SAFE_DEFAULTS' order (the outputs' order), then the table of what they guard against."""
    return [*(value for value, _ in form.SAFE_DEFAULTS.values()), form.safe_defaults_table()]


def message_text(content) -> str:
    """A chat message's text: gradio 6 hands the history over as lists of parts ({"type": "text", "text"})."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


def chat_turn(page: Page):
    """The Chat tab's send: the conversation so far and the new message to the finished run, its answer added."""

    def turn(run, history, message):
        if not run:
            raise gr.Error("choose a finished run first", print_exception=False)
        messages = [{"role": m["role"], "content": message_text(m["content"])} for m in history or []]
        messages.append({"role": "user", "content": message})
        try:
            reply = page.finished.reply(run, messages)
        except UserError as exc:
            raise gr.Error(html.escape(str(exc), quote=False), print_exception=False) from None
        return [*messages, {"role": "assistant", "content": reply}], ""

    return turn


def _export(page: Page):
    def run_export(run, target, overwrite):
        if not run:
            return "choose a finished run first"
        try:
            result = page.finished.export(run, target or "", bool(overwrite))
        except UserError as exc:
            return f"**not exported:** {html.escape(str(exc))}"
        return f"exported `{run}` into `{result['name']}` ({result['merged_into']} of {result['base']})"

    return run_export
