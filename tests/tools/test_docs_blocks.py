"""Every ```python block of README.md and docs/*.md runs as written (issue 52 item 6), so a documented example
cannot rot: docs/optimizer.md's FusedMuon example once failed with `NameError: name 'schedules' is not defined`.

A block is run unmodified, after the setup it declares in an HTML comment on the line before it (invisible on the
rendered page), `<!-- docs-test: setup NAME ... -->`: each NAME a snippet of `SETUPS` below that defines what
the page's prose assumes (a model, a loader, ...) on the tiny scratch Llama. Two other words, after a `;`:
- `cuda`: the block needs a CUDA device (autocast, CUDA graphs); it runs where there is one;
- `not run: WHY, TEST`: a block that needs a multi-process launch or a live server; TEST names the test file that
  runs the same calls, and must exist.
A new block with no comment runs with no setup: it must be complete, or declare what it needs.

The blocks of one file run in one subprocess (torch and transformers imported once), each in a fresh namespace,
in a scratch working directory; the runner is this file (`python test_docs_blocks.py FILE`).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
import traceback

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->\s*$")

# what the prose around the blocks assumes, on the tiny scratch Llama (fused_stable.train.model.tiny)
SETUPS = {
    "tiny_lm": """
import torch
from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model
tokenizer = build_byte_tokenizer()
model = build_tiny_model(tokenizer)
_ids = torch.randint(3, 259, (3, 2, 16), generator=torch.Generator().manual_seed(0))
loader = [{"input_ids": x, "labels": x} for x in _ids]
batch = loader[0]
""",
    "optimizer": """
from fused_stable import FusedAdamW, GradScaler, schedules
opt = FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
scaler = GradScaler("cpu")
""",
    "schedule_lengths": "total_steps, warmup_steps = 100, 10",
    "param_split": """
from fused_stable import FusedAdamW
big = [p for p in model.parameters() if p.ndim == 2]
norms = [p for p in model.parameters() if p.ndim < 2]
""",
    "hf_trainer": """
from transformers import Trainer, TrainingArguments
ds = [{"input_ids": x, "labels": x} for x in torch.randint(3, 259, (8, 16), generator=torch.Generator().manual_seed(1))]
args = TrainingArguments("out", max_steps=1, report_to="none")
""",
    "sft_data": """
from datasets import Dataset
ds = Dataset.from_dict({"text": [f"{a} + {b} = {a + b}" for a in range(4) for b in range(2)]})
""",
    "nanogpt": """
import torch
class _NanoGPT(torch.nn.Module):  # nanoGPT's forward: (logits, loss)
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
    def forward(self, x, y):
        out = self.lm(input_ids=x, labels=y)
        return out.logits, out.loss
model = _NanoGPT(model)
def get_batch(split):
    return loader[0]["input_ids"], loader[0]["labels"]
dtype, max_iters, warmup_iters, log_interval = torch.bfloat16, 3, 1, 2
""",
    "accelerate": """
from accelerate import Accelerator
from fused_stable import FusedAdamW, schedules
""",
    "guard_files": """
import os
out_dir, log_every = "run", 2
def save_checkpoint(*_):  # the loop's own checkpoint functions (the trainer's: fused_stable.train.run.checkpoint)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "checkpoint.pt")
def restore_checkpoint(*_):
    saved = torch.load("checkpoint.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
""",
    "one_process_group": """
import os, socket
import torch.distributed as dist
from fused_stable import FusedAdamW
if not dist.is_initialized():  # a group of one process (gloo), as torchrun would give rank 0 of 1
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
path = "checkpoint"
""",
    "ddp_cuda": """
from torch.nn.parallel import DistributedDataParallel as DDP
device, local_rank = torch.device("cuda", 0), 0
""",
    "distributed_placeholders": """
tuner, dataset_rows = "lora", list(range(10))
loss = model(**batch).loss
def save(state):
    torch.save(state, "model.pt")
log = print
""",
    "cuda_graph": """
import torch
from fused_stable import FusedAdamW, GradScaler, schedules
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
loss_fn = torch.nn.functional.cross_entropy
_g = torch.Generator(device="cuda").manual_seed(0)
_x = torch.randn(6, 16, 64, device="cuda", generator=_g)
_y = torch.randint(0, 8, (6, 16), device="cuda", generator=_g)
batches = iter(list(zip(_x, _y)))
""",
}


def blocks(path: str) -> list[dict]:
    """The ```python blocks of a markdown file: line, code, setups, cuda, not_run (the reason or None)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        block = {"line": line, "code": match.group(1), "setups": [], "cuda": False, "not_run": None}
        directive = DIRECTIVE.search(before)
        for word in (w.strip() for w in (directive.group(1).split(";") if directive else [])):
            if word.startswith("setup "):
                block["setups"] += word.split()[1:]
            elif word == "cuda":
                block["cuda"] = True
            elif word.startswith("not run:"):
                block["not_run"] = word[len("not run:") :].strip()
            else:
                raise ValueError(f"{path}:{line}: unknown docs-test word {word!r} (setup NAMES | cuda | not run: WHY)")
        found.append(block)
    return found


def doc_files() -> list[str]:
    """README.md and every docs/*.md that holds a ```python block (a new page is picked up by itself)."""
    files = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
    return [os.path.relpath(f, REPO_ROOT) for f in files if blocks(f)]


def run_file(path: str) -> int:
    """The runner (in a subprocess, in a scratch directory): every runnable block of `path`, each in a fresh
    namespace after its setups; prints `ok`, `FAILED` (with the traceback), `cuda` or `not run` per block."""
    failed = 0
    for block in blocks(os.path.join(REPO_ROOT, path)):
        where = f"{path}:{block['line']}"
        if block["not_run"] is not None:
            print(f"not run {where}: {block['not_run']}", flush=True)
            continue
        if block["cuda"] and not __import__("torch").cuda.is_available():
            print(f"cuda {where}: needs a CUDA device, none here", flush=True)
            continue
        if "accelerate.state" in sys.modules:  # accelerate keeps one process-wide state: each block makes its own
            sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
        namespace = {"__name__": "__docs__"}
        start = time.perf_counter()
        try:
            for name in block["setups"]:
                exec(compile(SETUPS[name], f"<setup {name}>", "exec"), namespace)
            exec(compile(block["code"], where, "exec"), namespace)
        except BaseException:
            failed += 1
            print(f"FAILED {where}:\n{traceback.format_exc()}", flush=True)
            continue
        print(f"ok {where} {time.perf_counter() - start:.1f}s", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- the tests
def test_every_block_declares_known_setups_and_a_not_run_block_names_its_test():
    files = doc_files()
    assert "README.md" in files and "docs/optimizer.md" in files
    for path in files:
        for block in blocks(os.path.join(REPO_ROOT, path)):
            unknown = [name for name in block["setups"] if name not in SETUPS]
            assert not unknown, f"{path}:{block['line']}: unknown setup {unknown} (known: {', '.join(SETUPS)})"
            if block["not_run"] is not None:
                tests = re.findall(r"tests/\S+\.py", block["not_run"])
                assert tests and all(os.path.isfile(os.path.join(REPO_ROOT, t)) for t in tests), (
                    f"{path}:{block['line']}: a block that is not run names the test that runs its calls"
                )


@pytest.mark.parametrize("path", doc_files())
def test_the_python_blocks_run_as_written(path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), path],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAILED ", "cuda ", "not run "))]
    expected = blocks(os.path.join(REPO_ROOT, path))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert len(report) == len(expected), proc.stdout[-3000:]  # every block is accounted for


if __name__ == "__main__":
    sys.exit(run_file(sys.argv[1]))
