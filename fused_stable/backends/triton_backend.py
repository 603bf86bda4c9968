"""The fused step on the Triton kernels (backends "triton" and "interpret"): a plan's device tables, one step's
launches.

`TritonTables` is the device side of a StepPlan, built once per plan: the update table (param, moment, master
and step addresses, sizes, groups) and chunk maps per param dtype, the norm pass's partials, the decision
kernel's per-tensor tables, a grad-address array that is rewritten in place when grad storage changes, and
one `PreparedLaunch` per kernel launch (kernels/launch.py). A step then costs, on the host: a check of the
hyper-parameters, the launches through the compiled kernels' own launchers, and a device guard.

Launches run on the parameters' device whatever device is current (a guard switches only when needed) and on
that device's current stream. Everything that would copy host data to the device (a new plan, new grad
addresses, changed float hyper-parameters) goes through kernels.tables.upload, which refuses to run while a
CUDA graph is being captured.
"""

from __future__ import annotations

import contextlib
import operator

import torch

from .. import layout
from ..kernels.tables import CHUNK_SIZE, build_chunk_map, check_not_capturing, upload, upload_int64
from ..layout import StepBuffers, StepPolicy
from ..plan import StepPlan, check_grads
from ..rules import H_SIZE

DENSE_LAYOUTS = True  # the kernels walk memory linearly (fused_stable.backends.Backend)


def compiled_cpu_ops() -> bool:
    """The kernels' steps: no compiled CPU op (fused_stable.backends.Backend)."""
    return False


def _another_device_is_current(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.current_device() != device.index


def device_guard(device: torch.device):
    """Makes `device` current for the launches (Triton launches on the current device), only when it is not."""
    return torch.cuda.device(device.index) if _another_device_is_current(device) else contextlib.nullcontext()


class TritonTables:
    """The device side of one plan for the Triton kernels (see the module doc)."""

    def __init__(
        self,
        plan: StepPlan,
        buffers: StepBuffers,
        policy: StepPolicy,
        device: torch.device,
        *,
        sumsq_config=None,
        adamw_config=None,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        """Launch configurations and chunk size default to the kernels' own; benchmarks/gpu_probe.py builds the
        same tables with the alternatives it times."""
        from ..kernels.decide import prepare_decide

        self.buffers, self.policy, self.device = buffers, policy, device
        self.rule = plan.rule
        self.group_rules = plan.group_rules
        launch_groups = _launch_groups(plan)
        self.kernel_order = [i for indices in launch_groups.values() for i in indices]
        n = len(self.kernel_order)
        # plan order -> kernel order, in C (None: the same order, one launch group as usual)
        self.to_kernel_order = None if self.kernel_order == list(range(n)) else operator.itemgetter(*self.kernel_order)
        self.grad_addrs = torch.zeros(max(n, 1), dtype=torch.int64, device=device)
        self.grads_version = -1
        self.uploaded_grad_ptrs: list[int] | None = None

        chunk_maps, counts, owners = _chunk_maps(plan, launch_groups, device, chunk_size)
        self.partials = torch.zeros(max(len(owners), 1), dtype=torch.float32, device=device)
        self.per_tensor_sumsq = torch.zeros(n, dtype=torch.float32, device=device)
        self.chunk_owner = upload_int64(owners, device)
        self.positions = upload_int64([plan.positions[i] for i in self.kernel_order], device)
        self.originals = [plan.params[i] for i in self.kernel_order]
        self.norms, self.updates = self._prepare_passes(plan, launch_groups, chunk_maps, sumsq_config, adamw_config)
        self.decide = prepare_decide(
            partials=self.partials,
            chunk_owner=self.chunk_owner,
            tensor_num_chunks=upload_int64(counts, device),
            per_tensor_sumsq=self.per_tensor_sumsq,
            tensor_positions=self.positions,
            step_addrs=upload_int64([plan.steps[i].data_ptr() for i in self.kernel_order], device),
            buffers=buffers,
            policy=policy,
        )
        self.hparams_rows: list | None = None  # the rows last checked, as handed over (compared by identity)
        self.hparams_key: tuple | None = None
        self.tensor_lrs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (hparams slot, the group's lr tensor)

    def _prepare_passes(self, plan: StepPlan, launch_groups: dict, chunk_maps: list, sumsq_config, adamw_config):
        """One norm-pass and one update launch per launch group (those with nothing to read left out)."""
        from ..kernels.norm import SUMSQ_CONFIG, prepare_sumsq
        from ..kernels.update import TABLE_COLUMNS, UPDATE_CONFIG, prepare_update

        norms, updates = [], []
        for ((dtype, has_master, option, state_format_id, updated), indices), (chunks, partial_offset, first) in zip(
            launch_groups.items(), chunk_maps
        ):
            grad_addrs = self.grad_addrs[first : first + len(indices)]
            numels = upload_int64([plan.numels[i] for i in indices], self.device)
            norm = prepare_sumsq(
                grad_addrs, numels, chunks, self.partials, partial_offset, dtype, sumsq_config or SUMSQ_CONFIG
            )
            if norm is not None:
                norms.append(norm)
            if not updated:  # a group without a rule: measured and decided for, updated elsewhere
                continue
            table = upload_int64(_update_rows(plan, indices), self.device, "an update table")
            update = prepare_update(
                table=table.view(len(indices), TABLE_COLUMNS),
                grad_addrs=grad_addrs,
                chunks=chunks,
                hparams=self.buffers.hparams,
                fstate=self.buffers.fstate,
                param_dtype=dtype,
                has_master=has_master,
                rule=plan.rule,
                option=option,
                state_format_id=state_format_id,
                config=adamw_config or UPDATE_CONFIG,
            )
            if update is not None:
                updates.append(update)
        return norms, updates

    def refresh_grads(self, plan: StepPlan) -> None:
        """Writes new grad addresses into the address array the prepared launches read (when they differ from
        what it holds: grads can come back to an earlier storage, e.g. after a step refused during a capture)."""
        if plan.grad_ptrs != self.uploaded_grad_ptrs:
            ptrs = plan.grad_ptrs if self.to_kernel_order is None else list(self.to_kernel_order(plan.grad_ptrs))
            upload(ptrs, torch.int64, self.device, "new gradient addresses", out=self.grad_addrs[: len(ptrs)])
            self.uploaded_grad_ptrs = plan.grad_ptrs
        self.grads_version = plan.grads_version

    def refresh_hparams(self, hparams: list) -> None:
        """Uploads changed float hyper-parameters; copies tensor lrs device-to-device every step (no sync).
        The optimizer hands the same list while its values stay: then one identity check is all. Rows are read
        by position, in the rule's HParams order (rules/declaration.py; benchmarks/gpu_probe.py passes plain tuples)."""
        if hparams is not self.hparams_rows:
            key = tuple(row if not isinstance(row[0], torch.Tensor) else (id(row[0]), *row[1:]) for row in hparams)
            if key != self.hparams_key:
                upload(
                    [
                        rule.hparam_row(*row, size=H_SIZE) if rule is not None else layout.lr_row(*row, size=H_SIZE)
                        for rule, row in zip(self.group_rules, hparams)
                    ],
                    torch.float32,
                    self.device,
                    "changed hyper-parameters",
                    out=self.buffers.hparams,
                )
                self.hparams_key = key
                self.tensor_lrs = [
                    (self.buffers.hparams[g, layout.H_LR], row[0])
                    for g, row in enumerate(hparams)
                    if isinstance(row[0], torch.Tensor)
                ]
            self.hparams_rows = hparams
        for slot, lr in self.tensor_lrs:
            slot.copy_(lr)


def _launch_groups(plan: StepPlan) -> dict[tuple, list[int]]:
    """(param dtype, has master, the rule's group option, state format, updated) -> plan indices: one norm and one
    update launch per group (so a step launches once more per further dtype or state format, never per tensor);
    no update launch for the params of groups without a rule (plan.updated)."""
    launch_groups: dict[tuple, list[int]] = {}
    options = plan.group_options
    for index, (param, master, group, fmt, updated) in enumerate(
        zip(plan.local_params, plan.masters, plan.groups, plan.formats, plan.updated)
    ):
        key = (param.dtype, master is not None, options[group], fmt, updated)
        launch_groups.setdefault(key, []).append(index)
    return launch_groups


def _chunk_maps(plan: StepPlan, launch_groups: dict, device: torch.device, chunk_size: int):
    """Per launch group its chunk map, its offset into the partials and its first tensor in kernel order; the
    chunk count of every tensor and the owner (kernel-order tensor) of every chunk, across groups."""
    chunk_maps, counts, owners, first = [], [], [], 0
    for indices in launch_groups.values():
        chunks = build_chunk_map([plan.numels[i] for i in indices], device, chunk_size)
        chunk_maps.append((chunks, len(owners), first))
        counts += chunks.tensor_num_chunks
        for local, count in enumerate(chunks.tensor_num_chunks):
            owners += [first + local] * count
        first += len(indices)
    return chunk_maps, counts, owners


def _update_rows(plan: StepPlan, indices: list[int]) -> list[int]:
    """The update table of one launch group, row by row in kernels/update.py's column order (COL_*): the param,
    master, step, size, group, position and first element's index in the whole param, then the rule's states and
    their 8-bit scales, each padded with 0 to the kernel's MAX_STATES slots."""
    from ..kernels.update import MAX_STATES

    rows, positions = [], plan.positions
    address = lambda t: t.data_ptr() if t is not None else 0  # noqa: E731
    for i in indices:
        states, scales = plan.states[i], plan.scales[i]
        padding = [0] * (MAX_STATES - len(states))
        rows += [
            plan.local_params[i].data_ptr(),
            address(plan.masters[i]),
            plan.steps[i].data_ptr(),
            plan.numels[i],
            plan.groups[i],
            positions[i],
            plan.element_offsets[i],
            *map(address, states),
            *padding,
            *map(address, scales),
            *padding,
        ]
    return rows


def fused_step(
    plan: StepPlan,
    grads: list[torch.Tensor],
    buffers: StepBuffers,
    policy: StepPolicy,
    hparams: list,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    global_sumsq,
) -> None:
    """Norm pass, decision kernel and the rule's update for every tensor of `plan`, on the parameters' device
    (`fused_stable.backends.Backend.fused_step`)."""
    device = buffers.fstate.device
    tables: TritonTables | None = plan.backend_cache
    if tables is None or tables.buffers is not buffers or tables.policy is not policy:
        tables = plan.backend_cache = TritonTables(plan, buffers, policy, device)
    if tables.grads_version != plan.grads_version:
        tables.refresh_grads(plan)
    tables.refresh_hparams(hparams)
    if grad_scale is not None and grad_scale.dtype != torch.float32:
        grad_scale = grad_scale.float()
    if found_inf is not None and found_inf.dtype != torch.float32:
        found_inf = found_inf.float()
    if _another_device_is_current(device):  # Triton launches on the current device: make it the params' one
        with torch.cuda.device(device.index):
            launch_step(tables, grad_scale, found_inf, global_sumsq)
    else:  # no context manager at all in the usual case: this is host time per step
        launch_step(tables, grad_scale, found_inf, global_sumsq)


def launch_step(tables: TritonTables, grad_scale=None, found_inf=None, global_sumsq=None) -> None:
    """The launches of one step over `tables`, on the current device's current stream."""
    kernels = _kernels or _import_kernels()
    device = tables.device
    stream = kernels.current_stream(device.index or 0)
    for norm in tables.norms:
        kernels.run_sumsq(norm, grad_scale, stream)
    external_sumsq = None
    if global_sumsq is not None:
        local = torch.zeros_like(tables.per_tensor_sumsq).index_add_(
            0, tables.chunk_owner, tables.partials[: tables.chunk_owner.numel()]
        )
        external_sumsq = global_sumsq(local, tables.originals).reshape(()).float()
    kernels.run_decide(tables.decide, stream, grad_scale, found_inf, external_sumsq)
    for update in tables.updates:
        kernels.run_update(update, stream)


_kernels = None


def _import_kernels():
    """The kernel modules, imported on first use: importing triton must wait until a kernel really runs (the
    interpreter is chosen when triton is first imported)."""
    global _kernels
    from types import SimpleNamespace

    from ..kernels import decide, launch, norm, update

    _kernels = SimpleNamespace(
        current_stream=launch.current_stream,
        run_sumsq=norm.run_sumsq,
        run_decide=decide.run_decide,
        run_update=update.run_update,
    )
    return _kernels


# --------------------------------------------------------------------------------------------------
# clip_grad_norm_: multi-tensor norm and in-place scale


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s L2 case with the fused kernels: returns the total norm.

    The kernels give each chunk's sum of squares (fp32 accumulation); the rest follows torch's own steps on a few
    small device tensors, so results and dtypes are torch's: every grad's norm in its own dtype (an fp16 norm
    above 65504 is inf, and the grads are then zeroed, as in torch), the total as the norm of those norms in their
    promoted dtype (all-fp32 grads: one fp32 sum, which those roundings would not change), the coefficient
    min(1, max_norm / (total + 1e-6)) in that dtype, and each grad multiplied by
    it with one rounding. `error_if_nonfinite` raises before any grad changes.

    One-off tables per call (a clip over a varying set of grads has nothing to cache against), so it cannot run
    inside a CUDA-graph capture: the upload refuses with a clear error."""
    from ..kernels.launch import current_stream
    from ..kernels.norm import launch_scale_, prepare_sumsq, run_sumsq

    device = grads[0].device
    check_not_capturing(device, "clip_grad_norm_'s tables")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # in first-seen order, as torch groups them
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    maps, owners, offset, first = [], [], 0, 0
    for dtype, tensors in by_dtype.items():
        check_grads(tensors, tensors, dense_layouts=True)
        chunks = build_chunk_map([t.numel() for t in tensors], device)
        addrs = upload_int64([t.data_ptr() for t in tensors], device, "clip_grad_norm_'s tables")
        numels = upload_int64([t.numel() for t in tensors], device, "clip_grad_norm_'s tables")
        maps.append((dtype, chunks, addrs, numels, offset, first, len(tensors)))
        for local, count in enumerate(chunks.tensor_num_chunks):
            owners += [first + local] * count
        offset += chunks.num_chunks
        first += len(tensors)
    partials = torch.zeros(max(offset, 1), dtype=torch.float32, device=device)
    chunk_owner = upload_int64(owners, device, "clip_grad_norm_'s tables")
    with device_guard(device):
        stream = current_stream(device.index or 0)
        for dtype, chunks, addrs, numels, part_offset, _, _ in maps:
            prepared = prepare_sumsq(addrs, numels, chunks, partials, part_offset, dtype)
            if prepared is not None:
                run_sumsq(prepared, None, stream)
        if list(by_dtype) == [torch.float32]:  # rounding the per-tensor norms changes nothing: one fp32 sum
            total_norm = partials.sum().sqrt()
        else:
            sumsq = torch.zeros(first, dtype=torch.float32, device=device).index_add_(0, chunk_owner, partials[:offset])
            norms = sumsq.sqrt()
            per_tensor = [norms[start : start + count].to(dtype) for dtype, *_, start, count in maps]
            total_norm = torch.linalg.vector_norm(torch.cat(per_tensor), 2.0)  # cat promotes, as torch's stack does
        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):  # torch syncs here too
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped. "
                "To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total_norm + layout.CLIP_EPS), max=1.0).to(torch.float32)  # exact widening
        for dtype, chunks, addrs, numels, *_ in maps:
            launch_scale_(addrs, numels, chunks, dtype, coef)
    return total_norm
