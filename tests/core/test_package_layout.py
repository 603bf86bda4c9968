"""The package's rooms, read from its source with `ast` (nothing is imported for the checks on the source):

- no arrow up: no core module imports integrations/, train/, stress, bench/ or webui/, at top level or in a function;
- devtools/ (codegen, standin) are tools over the kernels: nothing else in the package imports them;
- no import circle (the whole package, each module's imports of any kind counted);
- no module over 500 lines; no function over 80 lines, anywhere in the package;
- one backend registry: every backend module implements the `Backend` protocol, and only ops.py names them;
- every module has its line in docs/design.md's module map;
- the decision kernel's sections and the torch backend's functions carry the same names, in the same order.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fused_stable"
ROOT = "fused_stable"

# where the application lives; the core (everything else) must not import it
APPLICATION = (
    "fused_stable.integrations",
    "fused_stable.train",
    "fused_stable.stress",
    "fused_stable.bench",
    "fused_stable.webui",
)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# Known exceptions, each with its reason; an entry that no longer applies fails below, so it is removed when the
# reason goes. None today.
LONG_MODULES: dict[str, str] = {}
CYCLES: dict[frozenset, str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imports(name: str) -> set[str]:
    """The package modules `name` imports, anywhere in its source (functions and TYPE_CHECKING blocks too)."""
    tree = ast.parse(MODULES[name].read_text())
    base = name if _is_package(name) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name` the module
            candidates = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in MODULES:
                candidate = candidate.rpartition(".")[0]
            if candidate:
                targets.add(candidate)
    # importing a module runs its packages' __init__ too, but those arrows are implied, not written
    parents = {t for t in targets if name.startswith(t + ".") and _is_package(t)}
    return targets - parents - {name, ROOT}


GRAPH = {name: _imports(name) for name in MODULES}


def _core(name: str) -> bool:
    return not _in(name, APPLICATION)


def test_no_core_module_imports_the_application():
    upward = {
        name: sorted(t for t in targets if _in(t, APPLICATION))
        for name, targets in GRAPH.items()
        if _core(name) and any(_in(t, APPLICATION) for t in targets)
    }
    assert upward == {}, f"core modules importing integrations/, train/, stress, bench/ or webui/: {upward}"


DEVTOOLS = ("fused_stable.devtools",)


def test_devtools_are_imported_by_no_other_module():
    """codegen.py and standin.py check the kernels from outside (tests, benchmarks, `python -m`); a kernel or the
    step importing them would put a tool, and its triton-only imports, on the optimizer's path."""
    assert {"fused_stable.devtools.codegen", "fused_stable.devtools.standin"} <= set(MODULES)
    assert "fused_stable.kernels.update" in GRAPH["fused_stable.devtools.codegen"]  # the check reads the edges
    importing = {
        name: sorted(t for t in targets if _in(t, DEVTOOLS))
        for name, targets in GRAPH.items()
        if not _in(name, DEVTOOLS) and any(_in(t, DEVTOOLS) for t in targets)
    }
    assert importing == {}, f"modules importing devtools/: {importing}"


def _cycles() -> list[frozenset]:
    """The strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    cycles = _cycles()
    unexpected = [sorted(c) for c in cycles if c not in CYCLES]
    assert unexpected == [], f"import circles: {unexpected}"
    stale = [sorted(c) for c in CYCLES if c not in cycles]
    assert stale == [], f"these known circles are gone: remove them from CYCLES in {__file__}: {stale}"


def test_no_module_over_500_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES and name not in LONG_MODULES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: {over}"
    stale = [name for name in LONG_MODULES if lengths.get(name, 0) <= MAX_MODULE_LINES]
    assert stale == [], f"no longer over {MAX_MODULE_LINES} lines (or gone): remove from LONG_MODULES: {stale}"


def test_no_function_over_80_lines():
    over = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over.append(f"{name}.{node.name}: {lines} lines")
    assert over == []


DESIGN = PACKAGE.parent / "docs" / "design.md"


def mapped_paths(text: str) -> set[str]:
    """The module paths docs/design.md's module maps name, relative to the package: in its code blocks, a line whose
    first word ends with "/" opens a folder for the lines indented below it (`backends/` then `  torch/` then
    `    updates.py` is backends/torch/updates.py); a line indented under a file (`optim.py` then `  readouts.py`) is
    that file's helper in the same folder."""
    paths, folders, in_block = set(), [], False  # folders: (indent, "name/") of the open folders
    for line in text.splitlines():
        if line.startswith("```"):
            in_block, folders = not in_block, []
            continue
        if not in_block or not line.strip():
            continue
        indent, word = len(line) - len(line.lstrip()), line.split()[0]
        folders = [(i, f) for i, f in folders if i < indent]
        prefix = "".join(f for _, f in folders)
        if word.endswith("/"):
            folders.append((indent, word))
        elif word.endswith(".py"):
            paths.add(prefix + word)
    return paths


def test_every_module_is_in_the_module_map():
    named = mapped_paths(DESIGN.read_text())
    missing = []
    for path in MODULES.values():
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and relative != "__init__.py":
            continue  # a folder's own line stands for its __init__
        if relative not in named:
            missing.append(relative)
    assert missing == [], f"modules without their line in docs/design.md's module map: {missing}"
    assert {"optim.py", "backends/torch/updates.py", "train/run/loop.py", "rules/adamw/triton.py"} <= named


# FusedAdamW's own modules: the class, the mixins it is made of and its state mapping; the rest of the package uses its
# package-internal surface (optim.py says which names)
BENCHMARKS = PACKAGE.parent / "benchmarks"  # the scripts use the same surface
OPTIMIZER_MODULES = (
    "fused_stable.optim",
    "fused_stable.readouts",
    "fused_stable.state_dict",
    "fused_stable.shown_lrs",
    "fused_stable.param_state",
)


def _private_members_set_on_self(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }


def test_no_module_reads_the_optimizers_private_members():
    private = set()
    for name in OPTIMIZER_MODULES:
        private |= _private_members_set_on_self(ast.parse(MODULES[name].read_text()))
    assert {"_plan", "_fstate", "_version", "_hparams"} <= private  # the check sees them
    reached = []
    benchmarks = {f"benchmarks/{p.relative_to(BENCHMARKS).as_posix()}": p for p in BENCHMARKS.rglob("*.py")}
    for name, path in {**MODULES, **benchmarks}.items():
        if name in OPTIMIZER_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    reached.append(f"{name}:{node.lineno}: .{node.attr}")
    assert reached == [], f"FusedAdamW's private members used outside it (use its package-internal surface): {reached}"


def test_the_checks_see_what_they_claim():
    """The graph is read right: the edges the checks rely on are there (or every check above would pass empty)."""
    assert {"fused_stable.sharding", "fused_stable.plan", "fused_stable.ops"} <= GRAPH["fused_stable.optim"]
    assert "fused_stable.kernels.decide" in GRAPH["fused_stable.backends.triton_backend"]  # a function-level import
    assert "fused_stable.sharding" in GRAPH["fused_stable.integrations.distributed"]
    assert not _core("fused_stable.train.run.loop") and _core("fused_stable.kernels.update")
    assert "fused_stable.rules" in GRAPH["fused_stable.optim"]


# the step's machinery: it may read the rules registry and the declaration's types, never import a rule by name (a
# new rule is new files only)
DECLARATION = "fused_stable.rules.declaration"
RULE_FREE = (
    "fused_stable.plan",
    "fused_stable.state_format",
    "fused_stable.state_dict",
    "fused_stable.shown_lrs",
    "fused_stable.kernels.update",
    "fused_stable.kernels.decide",
    "fused_stable.backends.triton_backend",
    "fused_stable.backends.torch.torch_backend",
    "fused_stable.backends.torch.exact_reference",
)


def test_the_step_machinery_names_no_rule():
    named = {
        name: sorted(t for t in GRAPH[name] if t.startswith("fused_stable.rules.") and t != DECLARATION)
        for name in RULE_FREE
    }
    assert {name: targets for name, targets in named.items() if targets} == {}


def test_one_backend_registry_and_one_protocol():
    """ops.BACKENDS is the one registry: both backend modules implement `Backend` (the same fused_step signature,
    DENSE_LAYOUTS), compiled.py reads the registry, and no core module but ops.py names a backend module."""
    from fused_stable import ops
    from fused_stable.backends import Backend, triton_backend
    from fused_stable.backends.torch import torch_backend

    assert set(ops.BACKENDS) == {"triton", "interpret", "torch"}
    assert ops.BACKENDS["torch"] is torch_backend and ops.BACKENDS["triton"] is ops.BACKENDS["interpret"]
    expected = list(inspect.signature(Backend.fused_step).parameters)[1:]  # without self
    for module in (torch_backend, triton_backend):
        assert isinstance(module, Backend), module.__name__
        assert list(inspect.signature(module.fused_step).parameters) == expected, module.__name__
        assert isinstance(module.DENSE_LAYOUTS, bool)
    assert [ops.needs_dense_layouts(name) for name in ("triton", "interpret", "torch")] == [True, True, False]
    naming = {
        name
        for name, targets in GRAPH.items()
        if _core(name)
        and not name.startswith("fused_stable.backends")
        and targets & {"fused_stable.backends.torch.torch_backend", "fused_stable.backends.triton_backend"}
    }
    assert naming == {"fused_stable.ops"}


def _called_in(function: ast.FunctionDef) -> list[str]:
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return [c.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


SHARED_WITH_THE_TENSOR_DECISIONS = ("per_tensor_sums", "keep_worst", "advance_steps")


def test_decision_sections_have_the_same_names_and_order_in_both_backends():
    """kernels/decide.py's `_decide_kernel` is a sequence of jit helpers; backends/torch/torch_decide.py (0-dim
    tensors) and backends/torch/host_decide.py (host scalars) define functions of the same names in the same
    order, so the three can be compared section by section."""
    decide = ast.parse(MODULES["fused_stable.kernels.decide"].read_text())
    kernel_helpers = {n.name for n in decide.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    (kernel,) = [n for n in decide.body if isinstance(n, ast.FunctionDef) and n.name == "_decide_kernel"]
    sections = [name for name in _called_in(kernel) if name in kernel_helpers]
    assert len(sections) == len(set(sections)) >= 9, sections
    for module in ("fused_stable.backends.torch.torch_decide", "fused_stable.backends.torch.host_decide"):
        tree = ast.parse(MODULES[module].read_text())
        defined = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        missing = [name for name in sections if name not in defined]
        if module.endswith("host_decide"):  # steps around the decisions that both kinds share (torch_decide.py)
            missing = [name for name in missing if name not in SHARED_WITH_THE_TENSOR_DECISIONS]
        assert missing == [], f"{module} has no function for these sections: {missing}"
        present = [name for name in sections if name in defined]
        assert sorted(present, key=defined.index) == present, f"{module} defines them in another order"


def test_hparams_reach_the_backends_by_name():
    import torch

    from fused_stable import FusedAdamW, schedules

    HParams = FusedAdamW.RULE.HParams  # noqa: N806 (a class, derived from AdamW's declaration)
    assert HParams._fields == ("lr", "betas", "eps", "weight_decay", "maximize")
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    groups = [{"params": params[:1], "betas": (0.8, 0.9), "eps": 1e-6}, {"params": params[1:], "maximize": True}]
    opt = FusedAdamW(groups, lr=0.5, weight_decay=0.25, lr_schedule=schedules.constant(3), backend="torch")
    first, second = opt.hparam_rows()
    assert first == HParams(lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.25, maximize=False)
    assert second.maximize is True and second.lr == 0.5  # with a schedule: the base lr, not the shown tensor


def test_the_core_imports_without_triton():
    """kernels/__init__.py says it: the package, the optimizer, the backends and tables.py import no triton
    until a kernel runs (the interpreter has to be chosen before triton's first import)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_STABLE_BACKEND")}
    code = (
        "import sys, fused_stable, fused_stable.kernels, fused_stable.kernels.tables, fused_stable.ops, "
        "fused_stable.compiled, fused_stable.sharding; print('triton' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_every_layout_constant_the_kernels_read_is_in_their_cache_key():
    """The kernels' jit helpers take the buffer slots as constexpr defaults, which Triton's cache key does not
    hold: each kernel takes `LAYOUT` (every layout.py constant, by name and value, and the table's width
    rules.H_SIZE), and the update kernel's `RULE` carries the rule's row_layout (its slots of the hyper-parameter
    row, from its declaration) and its jit functions' source hash, so a slot that moves, or a rule's math that
    changes, recompiles instead of reading a stale cached binary. Checked: every `layout.X` default in a kernel
    module is in its string, every default of a rule's Triton file is a `layout.X` or a `SLOT.H_NAME` (RULE.slots) of a
    declared slot (in row_layout), and the kernels that read slots take them."""
    from fused_stable import layout
    from fused_stable.kernels import decide, rule_arg, update
    from fused_stable.rules import ELEMENTWISE, H_SIZE

    layout_names = dict(item.split("=") for item in update.KERNEL_LAYOUT.split(";"))
    assert layout_names["H_SIZE"] == str(H_SIZE)
    for module in ("fused_stable.kernels.decide", "fused_stable.kernels.update"):
        for owner, name in _attribute_defaults(module):
            if owner == "layout" and name != "KERNEL_LAYOUT":
                assert layout_names.get(name) == repr(getattr(layout, name)), name
    for rule in ELEMENTWISE.values():
        row_names = dict(item.split("=") for item in rule.row_layout.split(";"))
        module = rule.package + ".triton"
        defaults = _attribute_defaults(module)
        slots = [name for owner, name in defaults if owner == "SLOT"]
        assert slots, f"{rule.name}'s triton.py reads no slot by its name"
        for name in slots:
            assert name.startswith("H_") and row_names.get(name[2:].lower()) == str(getattr(rule.slots, name)), name
        for owner, name in defaults:
            assert owner == "SLOT" or (owner == "layout" and layout_names.get(name) == repr(getattr(layout, name)))
        jit = importlib.import_module(module)
        for option in (False, True) if rule.option else (False,):
            constant = rule_arg.rule_constexpr(rule, option)
            assert constant[6] == rule.row_layout
            assert constant[7] == rule_arg.source_key(jit.step_scalars) + rule_arg.source_key(jit.element)
            assert constant[7] or os.environ.get("TRITON_INTERPRET") == "1"  # compiled kernels: a real hash
    for kernel in (decide._decide_kernel, update._update_kernel):
        assert inspect.signature(kernel.fn).parameters["LAYOUT"].default == update.KERNEL_LAYOUT


def _attribute_defaults(module: str) -> list[tuple[str, str]]:
    """(owner, name) of every `owner.name` default of a jit function's arguments in `module`."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.FunctionDef):
            for default in node.args.defaults + node.args.kw_defaults:
                owner = getattr(default, "value", None)
                if isinstance(default, ast.Attribute) and isinstance(owner, ast.Name):
                    found.append((owner.id, default.attr))
    return found
