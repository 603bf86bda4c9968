"""The engine matrix's harness (test_engine_matrix.py): one cell is a rule x engine x state precision.

A cell trains a tiny Llama for STEPS optimizer steps under its engine with the rule's fused optimizer, recording
what the optimizer was given: the params before the first step, each step's grads as the optimizer sees them (after
the engine's backward and all-reduce, before its step) and the params after the last step. Then two replays on
copies of the first params, from the recorded grads, in a plain loop:
  - the rule's fused optimizer, built by the test (never read from the cell: a cell that built another rule or
    other groups cannot hide it), at the cell's precision: the engine changes nothing of the update, so the cell's
    final params are the replay's bit for bit;
  - the rule's reference (torch's optimizer, lion-pytorch's Lion; Muon: torch.optim.Muon on the hidden matrices +
    torch.optim.AdamW on the rest) after `clip_grad_norm_`: the replayed fused update must be nearer to its own
    rule's reference than to any other rule's, by a wide margin (`identify`), and in fp32 within the floor of the
    reference against itself with the grads moved by one fp32 ulp.
A refused cell raises one line (a ValueError, NotImplementedError or torch.compile's wrapper of one).
"""

from __future__ import annotations

import os

import torch
from integ_models import TokenDataset, tiny_llama

from fused_stable import OPTIMIZERS, muon_param_groups
from fused_stable.integrations.distributed import destroy_distributed

RULES = ["adamw", "lion", "sgd", "adafactor", "muon"]
PRECISIONS = ["fp32", "bf16", "8bit"]
STEPS = 3
CLIP = 0.5  # below the tiny model's grad norms (1-3): the clip acts on every step
BATCH = 4
LR = {"adamw": 1e-3, "lion": 1e-4, "sgd": 1e-2, "adafactor": 1e-2, "muon": 2e-2}
# each rule's keywords besides lr (weight decay off: the HF Trainer's default, and one number fewer per engine)
KEYWORDS = {
    "adamw": dict(weight_decay=0.0),
    "lion": dict(weight_decay=0.0, betas=(0.9, 0.99)),
    "sgd": dict(weight_decay=0.0, momentum=0.9),
    "adafactor": dict(weight_decay=0.0),
    "muon": {},
}
# matrices of 4096+ elements (hidden 64, intermediate 128): 8-bit state applies to them (smaller tensors keep fp32)
MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def model(seed: int = 0) -> torch.nn.Module:
    return tiny_llama(seed, **MODEL)


def data(rank: int = 0, world: int = 1) -> torch.utils.data.Dataset:
    """STEPS batches of BATCH rows per rank (a rank's rows are its own)."""
    full = TokenDataset(n=BATCH * STEPS * world, seq=12)
    return torch.utils.data.Subset(full, range(rank, len(full), world))


def fused(rule: str, precision: str, net: torch.nn.Module, order: list[list[str]] | None = None, **extra):
    """The rule's fused optimizer as the test defines the cell: its class, lr, keywords, the clip, the precision;
    Muon over muon_param_groups (the hidden matrices on Muon, the rest on AdamW, one lr). `order`: the params'
    names by group as a cell's optimizer holds them (an engine may split them, as the HF Trainer's decay / no-decay
    groups): the same hyper-parameters, in that order, since bf16 stochastic rounding hashes a param's position."""
    cls = OPTIMIZERS[rule].cls
    options = dict(max_grad_norm=CLIP, state_precision=precision, **extra)
    if rule == "muon":
        return cls(muon_param_groups(net, lr=LR[rule], weight_decay=0.0), **options)
    params = dict(net.named_parameters())
    groups = [{"params": [params[n] for n in names]} for names in order] if order else list(params.values())
    return cls(groups, lr=LR[rule], **KEYWORDS[rule], **options)


def references(rule: str, net: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The rule's reference optimizers over `net` (foreach off: torch's for-loop, the one the fused step follows)."""
    params = list(net.parameters())
    if rule == "adamw":
        return [torch.optim.AdamW(params, lr=LR[rule], foreach=False, **KEYWORDS[rule])]
    if rule == "lion":
        from lion_pytorch import Lion

        return [Lion(params, lr=LR[rule], **KEYWORDS[rule])]
    if rule == "sgd":
        return [torch.optim.SGD(params, lr=LR[rule], foreach=False, **KEYWORDS[rule])]
    if rule == "adafactor":
        return [torch.optim.Adafactor(params, lr=LR[rule], foreach=False, **KEYWORDS[rule])]
    muon, adamw = muon_param_groups(net, lr=LR[rule], weight_decay=0.0)
    return [
        torch.optim.Muon(muon["params"], lr=LR[rule], weight_decay=0.0),
        torch.optim.AdamW(adamw["params"], lr=LR[rule], weight_decay=0.0, foreach=False),
    ]


class Record:
    """What the optimizer was given: params by name before the first step, each step's grads, params after."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net = net
        self.first = _snapshot(net)
        self.grads: list[dict[str, torch.Tensor]] = []
        self.last: dict[str, torch.Tensor] = {}
        self.order: list[list[str]] = []  # the optimizer's params by group, by name

    def holds(self, optimizer) -> None:
        names = {id(p): n for n, p in self.net.named_parameters()}
        self.order = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def before_step(self) -> None:
        self.grads.append({n: _full(p.grad).clone() for n, p in self.net.named_parameters() if p.grad is not None})

    def done(self) -> None:
        self.last = _snapshot(self.net)

    def plain(self) -> dict:
        return {"first": self.first, "grads": self.grads, "last": self.last, "order": self.order}


def _snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p).clone() for n, p in net.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


def replay(record: dict, make) -> dict[str, torch.Tensor]:
    """The recorded grads replayed in a plain loop from the recorded first params: `make(net)` gives the optimizers
    (a fused one, or references, which get `clip_grad_norm_` first). Returns the params after the last step."""
    net = model()
    net.load_state_dict(record["first"], strict=False)
    params = dict(net.named_parameters())
    optimizers = make(net)
    for grads in record["grads"]:
        for name, p in params.items():
            p.grad = grads[name].clone() if name in grads else None
        if not hasattr(optimizers[0], "grad_norm"):  # a reference: the clip first
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], CLIP)
        for opt in optimizers:
            opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def moved(record: dict, ulps: int) -> dict:
    """The record with every grad moved by `ulps` fp32 ulps (away from zero): the floor's input."""
    grads = []
    for step in record["grads"]:
        out = {}
        for name, g in step.items():
            for _ in range(ulps):
                g = torch.nextafter(g, g * 2 + torch.sign(g))
            out[name] = g
        grads.append(out)
    return {**record, "grads": grads}


def scaled(record: dict, factor: float) -> dict:
    """The record with every grad times `factor` (1 +- 2**-23: a clip coefficient one fp32 ulp off)."""
    return {**record, "grads": [{name: g * factor for name, g in step.items()} for step in record["grads"]]}


def distance(a: dict, b: dict, first: dict) -> float:
    """|(a - first) - (b - first)| over every param, relative to |b - first|: two updates' distance."""
    diff = torch.cat([(a[n].double() - b[n].double()).flatten() for n in b])
    step = torch.cat([(b[n].double() - first[n].double()).flatten() for n in b])
    return float(diff.norm() / step.norm())


# ---------------------------------------------------------------------------------------------- single process


def run_plain(rule: str, precision: str, compiled: bool = False) -> dict:
    from torch._dynamo.utils import counters

    net = model()
    record = Record(net)
    opt = fused(rule, precision, net, backend="torch")
    record.holds(opt)
    if compiled:
        # a fresh dynamo: each optimizer's step is another compile of the same code, and past dynamo's recompile
        # limit (8) it runs the frame eagerly, in silence: a cell would then test no compiled step at all
        torch._dynamo.reset()
        counters.clear()
    step = torch.compile(opt.step, backend="eager") if compiled else opt.step
    for batch in torch.utils.data.DataLoader(data(), batch_size=BATCH):
        net(**batch).loss.backward()
        record.before_step()
        step()
        opt.zero_grad()
    if compiled:
        assert counters["stats"]["unique_graphs"] > 0, "torch.compile(opt.step) ran eagerly: no graph was compiled"
    record.done()
    return record.plain()


def run_hf(rule: str, precision: str, out: str) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fused_stable.integrations.hf import fused_trainer_optimizers

    net = model()
    record = Record(net)
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR[rule],
        weight_decay=0.0,
        max_grad_norm=CLIP,
        lr_scheduler_type="constant",
        adam_beta2=KEYWORDS[rule].get("betas", (0.9, 0.999))[1],
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        logging_steps=1,
    )
    extra = {k: v for k, v in KEYWORDS[rule].items() if k == "momentum"}  # the Trainer has no momentum
    optimizers = fused_trainer_optimizers(net, args, rule=rule, state_precision=precision, **extra)
    record.holds(optimizers[0])

    class Before(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record.before_step()

    Trainer(model=net, args=args, train_dataset=data(), optimizers=optimizers, callbacks=[Before()]).train()
    record.done()
    return record.plain()


def run_lightning(rule: str, precision: str, out: str) -> dict:
    import lightning as L

    from fused_stable.integrations.lightning import FusedStableCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return fused(rule, precision, self.net)

    module = Module()
    record = Record(module.net)

    class Before(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            record.before_step()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[FusedStableCallback(), Before()],
        default_root_dir=out,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=BATCH))
    record.holds(trainer.optimizers[0])
    record.done()
    return record.plain()


# ---------------------------------------------------------------------------------------------- 2 gloo ranks


ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def spawned_rank(rank: int, world: int, store: str, out: str, engine: str) -> None:
    """One rank of `engine` ("ddp", "fsdp2" or "zeroN"): every rule x precision cell in turn, in one process
    group; rank 0 saves each cell's record (or its refusal) to `out`/<rule>-<precision>.pt."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if engine in ZERO_STAGES:
        from integ_deepspeed import setup_rank

        os.environ["WORLD_SIZE"] = str(world)
        setup_rank(rank)  # DeepSpeed's CPU accelerator and its op build folder, before it is imported
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for rule in RULES:
            for precision in PRECISIONS:
                cell = _zero_cell if engine in ZERO_STAGES else _spawned_cell
                result = cell(engine, rule, precision, rank, world)
                if rank == 0:
                    torch.save(result, os.path.join(out, f"{rule}-{precision}.pt"))
                dist.barrier()
    finally:
        destroy_distributed()  # frees the group (DeepSpeed's comm layer may still hold it in ZeRO cells)


def _wrapped(engine: str, net: torch.nn.Module) -> torch.nn.Module:
    """DDP around the model, or FSDP2's fully_shard per decoder layer and at the root (params become Shard(0)
    DTensors; the records hold them whole)."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net)
    from torch.distributed.fsdp import fully_shard

    for layer in net.model.layers:
        fully_shard(layer)
    return fully_shard(net)


def _spawned_cell(engine: str, rule: str, precision: str, rank: int, world: int) -> dict:
    net = model()
    wrapped = _wrapped(engine, net)
    record = Record(net)
    try:
        opt = fused(rule, precision, net)
    except (ValueError, NotImplementedError) as exc:  # refused before anything runs: the same on every rank
        return {"refused": str(exc)}
    record.holds(opt)
    for batch in torch.utils.data.DataLoader(data(rank, world), batch_size=BATCH):
        wrapped(**batch).loss.backward()
        record.before_step()
        opt.step()
        opt.zero_grad()
    record.done()
    return record.plain()


def _zero_cell(engine: str, rule: str, precision: str, rank: int, world: int) -> dict:
    """A DeepSpeed ZeRO cell through fused_stable.integrations.deepspeed: the optimizer sees flat partitions, so
    no per-param grads are recorded; the first params and the full fp32 params after the last step are."""
    from deepspeed.utils import safe_get_full_fp32_param

    from fused_stable.integrations import deepspeed as fs_deepspeed

    net = model()
    first = _snapshot(net)
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": ZERO_STAGES[engine]}}
    try:
        opt = fused(rule, precision, net)
        engine_, *_ = fs_deepspeed.initialize(model=net, optimizer=opt, config=config)
    except (ValueError, NotImplementedError) as exc:  # refused before anything runs: the same on every rank
        return {"refused": str(exc)}
    for batch in torch.utils.data.DataLoader(data(rank, world), batch_size=BATCH):
        engine_.backward(engine_(**batch).loss)
        engine_.step()
    last = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in net.named_parameters()}
    return {"first": first, "grads": None, "last": last, "steps": int(engine_.global_steps)}
