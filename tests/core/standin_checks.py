"""Observations of the Triton backend's compiled launch path on CPU tensors, printed as one JSON object.

Run by tests/core/test_host_path.py in a process without TRITON_INTERPRET: the kernels are compiled for sm_90 as on
a GPU and launched through fused_stable.devtools.standin, whose launches are records (nothing runs, so tensor
contents never change). Each section below measures one claim of the step's host path.
"""

from __future__ import annotations

import json
import warnings

import torch
import triton.runtime as triton_runtime
from helpers import CountDeviceOps
from triton import knobs
from triton.runtime.jit import JITFunction

import fused_stable.ops as ops
from fused_stable import FusedAdamW, clip_grad_norm_
from fused_stable.devtools import codegen, standin
from fused_stable.guard import Guard
from fused_stable.kernels import decide, norm, update

KERNELS = (norm._sumsq_kernel, decide._decide_kernel, update._update_kernel)


def make_params(shapes, dtypes=(torch.float32,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(dtypes[i % len(dtypes)])) for i, s in enumerate(shapes)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    return params


def compiled_variants() -> int:
    return sum(len(cache[0]) for fn in KERNELS for cache in fn.device_caches.values())


def main() -> dict:
    out = {}
    dispatches = [0]
    dispatch = JITFunction.run

    def counting_run(self, *args, **kwargs):
        dispatches[0] += 1
        return dispatch(self, *args, **kwargs)

    JITFunction.run = counting_run
    ops.resolve_backend = lambda requested, device: "triton"  # CPU tensors on the compiled launch path
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught, standin.installed() as log:
        # launches per step, and how many of them went through Triton's dispatcher after the first step
        for name, shapes, dtypes in [
            ("3 fp32", [(7,)] * 3, (torch.float32,)),
            ("300 fp32", [(7 + i % 5,) for i in range(300)], (torch.float32,)),
            ("30 fp32+bf16", [(7,)] * 30, (torch.float32, torch.bfloat16)),
        ]:
            opt = FusedAdamW(make_params(shapes, dtypes), lr=1e-3, max_grad_norm=1.0, master_weights=True)
            opt.step()
            before, dispatched = log.count, dispatches[0]
            for _ in range(5):
                opt.step()
            out[f"launches per step, {name}"] = (log.count - before) / 5
            out[f"dispatches after the first step, {name}"] = dispatches[0] - dispatched

        # new grad storage: the address array is rewritten in place, the launches stay direct
        params = make_params([(100,), (3, 5)])
        opt = FusedAdamW(params, lr=1e-3, max_grad_norm=1.0)
        opt.step()
        for p in params:
            p.grad = p.grad.clone()
        before, dispatched = log.count, dispatches[0]
        opt.step()
        tables = opt._plan.backend_cache
        out["new grads: launches"] = log.count - before
        out["new grads: dispatches"] = dispatches[0] - dispatched
        out["new grads: address table is current"] = tables.grad_addrs.tolist() == [p.grad.data_ptr() for p in params]

        # other param sets (counts, sizes, chunk counts, offsets into the partials, a warm-up of 1): no new compile
        variants = compiled_variants()
        for shapes, dtypes, warmup in [
            ([(70_000,)], (torch.float32,), 1),
            ([(1,)], (torch.float32,), 25),
            ([(5 + i,) for i in range(64)] + [(140_000,)], (torch.float32, torch.bfloat16), 3),
        ]:
            opt = FusedAdamW(
                make_params(shapes, dtypes), lr=1e-3, max_grad_norm=1.0, master_weights=True, zscore_warmup=warmup
            )
            opt.step()
            opt.step()
        out["compiled variants before"] = variants
        out["new compilations for other param sets"] = compiled_variants() - variants

        # a mixed set: aligned tensors and an unaligned view; the update kernel launched for it keeps its 128-bit loop
        flat = torch.randn(3001)
        mixed = [
            torch.nn.Parameter(torch.randn(4096)),
            torch.nn.Parameter(flat[1:2049]),
            torch.nn.Parameter(torch.randn(2048)),
        ]
        for p in mixed:
            p.grad = torch.randn(p.shape)
        opt = FusedAdamW(mixed, lr=1e-3, max_grad_norm=1.0)
        opt.step()
        opt.step()
        ((update, _),) = opt._plan.backend_cache.updates
        ((sumsq, _),) = opt._plan.backend_cache.norms
        out["mixed set: unaligned view"] = mixed[1].data_ptr() % 16 != 0
        out["mixed set: update loops"] = codegen.loops(update.compiled().asm["ptx"])
        out["mixed set: norm loops"] = codegen.loops(sumsq.compiled(False).asm["ptx"])

        # clip_grad_norm_ on the fused kernels: one norm and one scale launch per dtype
        before = log.count
        clip_grad_norm_(mixed, 1.0)
        out["clip_grad_norm_ launches"] = log.names[-(log.count - before) :]

        # an installed launch hook (a profiler such as proton) sees every launch: those go through the dispatcher
        seen = []
        hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            opt.step()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        out["launch hook saw"] = seen

        # Triton's benchmarker (what an autotuner calls) under the stand-in: host time of real launches
        bench = triton_runtime.driver.active.get_benchmarker()
        before = log.count
        out["benchmarker: median ms"] = bench(opt.step, warmup=0, rep=5, return_mode="median")
        out["benchmarker: launches"] = log.count - before
        out["benchmarker: quantiles"] = bench(opt.step, warmup=0, rep=1, quantiles=[0.5, 0.9])

        # a guarded step: no launch and no torch op more than an unguarded one (the decision kernel keeps the
        # guard's worst-step window). Last: its zscore clip mode compiles another decision-kernel variant
        for guarded in (False, True):
            guard = Guard(policy="rollback")
            opt = FusedAdamW(
                make_params([(7,)] * 12), lr=1e-3, max_grad_norm=1.0, clip="zscore", **guard.config.optimizer_kwargs()
            )
            if guarded:
                guard.bind(opt)
            opt.step()
            before = log.count
            with CountDeviceOps() as counter:
                for _ in range(2, 7):
                    opt.step()
            kind = "guarded" if guarded else "unguarded"
            out[f"{kind} steps: launches"] = log.count - before
            out[f"{kind} steps: torch ops"] = counter.ops
    out["fp fusion warnings"] = [str(w.message) for w in caught if "FP_FUSION" in str(w.message)]
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
