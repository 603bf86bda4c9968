"""The multi-tensor update kernel: one launch per param dtype, after the norm pass and the decision kernel.

Every program reads the decisions of `_decide_kernel` (kernels/decide.py) from the device buffers: on a skipped
step it returns at once; otherwise it updates its chunk of one tensor with grad * (clip coefficient / loss
scale), the group's hyper-parameters and the scheduled lr, fp32 arithmetic, optional fp32 master weights, and
stores the param rounded to nearest even. What is the rule's (the scalars from its hyper-parameter row and the
per-element math) is the rule's `step_scalars` and `element` (rules/<rule>/triton.py, e.g. rules/adamw/triton.py),
which the kernel takes as one constexpr argument (kernels/rule_arg.py); what is here is rule-free: chunks and tails,
alignment, the skip, master weights, up to MAX_STATES state slots in the rule's order and the state formats'
loads and stores (codes, scales, stochastic rounding, as the rule's codecs say).

The buffer and table layouts reach the code as constexpr defaults, as in kernels/decide.py (whose module doc
says why, and why the kernel takes `LAYOUT`).

Rounding, against torch (fp contraction off in the update and decision kernels, IEEE `div_rn` / `sqrt_rn`):
torch's AdamW (for-loop and foreach paths) and the torch backend's decision ops evaluate one op at a time, each
rounded to fp32, with IEEE division and square root; Triton's defaults would contract `a * b + c` into one FMA
and use approximate division and square root (`div.full`, `sqrt.approx`). With contraction off and the `_rn`
functions the compiled kernels round exactly as the expressions are written, which is also what Triton's
interpreter does, so the CPU tests see the GPU's arithmetic (only `exp` and `cos`, in the bias correction and
the cosine schedule, stay approximate on the GPU). torch's own fused CUDA AdamW is compiled with contraction
on and differs from its foreach path in the last bit too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, state_format
from .common import (
    H_SIZE,
    KERNEL_LAYOUT,
    TRITON_DTYPES,
    aligned_block,
    as_pointer,
    is_aligned,
    load_address,
    to_storage,
)
from .launch import ArgTemplate, LaunchConfig, PreparedLaunch
from .rule_arg import MAX_STATES, rule_constexpr
from .state_codes import load_moment, mix32, moment_pointer, store_moment
from .tables import ChunkMap

# 8 warps x 32 threads x 4 elements = BLOCK: fp32 accesses are 128-bit and 16-bit param / grad accesses 64-bit,
# and both dtypes get the same register layout. With 8 elements per thread the 16-bit accesses would be
# 128-bit but the fp32 ones would not follow, and Triton would move every block through shared memory
# (bar.sync) to convert between the two layouts (tests/core/test_kernels_codegen.py checks this).
UPDATE_CONFIG = LaunchConfig(block=1024, num_warps=8, fp_fusion=False)

# update-table columns (int64 [num_tensors, TABLE_COLUMNS]); a state column past the rule's count is 0, a scale
# column 0 but for 8-bit state
COL_PARAM, COL_MASTER, COL_STEP, COL_NUMEL, COL_GROUP = range(5)
COL_POSITION = 5  # the param's index in the optimizer's flat order: keys bf16 stochastic rounding
COL_FIRST_ELEMENT = 6  # its first element's index in the whole param (sharding.element_offset): the rounding's bits
COL_STATE = 7  # MAX_STATES consecutive columns: the rule's states, in its order (its declaration: `state_names`)
COL_SCALE = COL_STATE + MAX_STATES  # MAX_STATES consecutive columns: their 8-bit scales
TABLE_COLUMNS = COL_SCALE + MAX_STATES


@triton.jit
def _load_states(
    states, scale_rows, mask, row_mask, RULE: tl.constexpr, STATE_FORMAT: tl.constexpr, FMT_Q8: tl.constexpr
):
    """The rule's states of one block as fp32 values; a slot past the rule's count is not read (slot 0's values
    stand in, and the rule's element leaves them alone)."""
    s0 = load_moment(states[0], scale_rows[0], mask, row_mask, STATE_FORMAT, RULE[4][0], FMT_Q8)
    s1 = s0
    s2 = s0
    if RULE[3] > 1:
        s1 = load_moment(states[1], scale_rows[1], mask, row_mask, STATE_FORMAT, RULE[4][1], FMT_Q8)
    if RULE[3] > 2:
        s2 = load_moment(states[2], scale_rows[2], mask, row_mask, STATE_FORMAT, RULE[4][2], FMT_Q8)
    return s0, s1, s2


@triton.jit
def _store_states(
    states,
    scale_rows,
    values,
    mask,
    row_mask,
    random,
    RULE: tl.constexpr,
    STATE_FORMAT: tl.constexpr,
    FMT_BF16: tl.constexpr,
    FMT_Q8: tl.constexpr,
):
    """Stores the rule's states in the state format, the last slot first (the order the AdamW kernel always stored
    them in); bf16 rounds stochastically where the rule says (state_format.py says why)."""
    if RULE[3] > 2:
        store_moment(
            states[2],
            scale_rows[2],
            values[2],
            mask,
            row_mask,
            random,
            STATE_FORMAT,
            RULE[4][2],
            FMT_BF16,
            FMT_Q8,
            RULE[5][2],
        )
    store_moment(
        states[0],
        scale_rows[0],
        values[0],
        mask,
        row_mask,
        random,
        STATE_FORMAT,
        RULE[4][0],
        FMT_BF16,
        FMT_Q8,
        RULE[5][0],
    )
    if RULE[3] > 1:
        store_moment(
            states[1],
            scale_rows[1],
            values[1],
            mask,
            row_mask,
            random,
            STATE_FORMAT,
            RULE[4][1],
            FMT_BF16,
            FMT_Q8,
            RULE[5][1],
        )


@triton.jit
def _update_block(
    pointers,
    mask,
    scalars,
    scale_rows,
    row_mask,
    random,
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    STATE_FORMAT: tl.constexpr,
    FMT_BF16: tl.constexpr,
    FMT_Q8: tl.constexpr,
    RULE: tl.constexpr,
):
    """The rule's element on one block, given its pointers (one per element: param, grad, master, and the rule's
    state slots); unmasked (vectorisable) when `mask` is None. `scalars` are the rule's `step_scalars`. This
    loads in the storage dtypes and state format, calls the element on fp32 values and stores: with 8-bit
    state the block is 2-D (a row per quantisation block), `scale_rows` point at the rows' scales of each state,
    and `row_mask` says which rows exist. `random` is what bf16 stochastic rounding draws from: (this tensor's
    key for this step, the block's element indices)."""
    param, grad, master, states = pointers
    other = None if mask is None else 0.0
    g = tl.load(grad, mask=mask, other=other).to(tl.float32)
    if HAS_MASTER:
        p = tl.load(master, mask=mask, other=other)
    else:
        p = tl.load(param, mask=mask, other=other).to(tl.float32)
    if RULE[3] > 0:
        s0, s1, s2 = _load_states(states, scale_rows, mask, row_mask, RULE, STATE_FORMAT, FMT_Q8)
    else:  # a rule keeping no state for this group (SGD without momentum): the slots stand in, never stored
        s0, s1, s2 = p, p, p
    p, s0, s1, s2 = RULE[1](p, g, s0, s1, s2, scalars, RULE[2])
    if RULE[3] > 0:
        _store_states(states, scale_rows, (s0, s1, s2), mask, row_mask, random, RULE, STATE_FORMAT, FMT_BF16, FMT_Q8)
    if HAS_MASTER:
        tl.store(master, p, mask=mask)
    tl.store(param, to_storage(p, PARAM_DTYPE), mask=mask)


@triton.jit
def _block_pointers(pointers, block_start, offsets, ALIGNED: tl.constexpr):
    """Each tensor's pointers to the elements of the block at `block_start`, marked 16-byte aligned if ALIGNED."""
    param, grad, master, states = pointers
    if ALIGNED:
        return (
            aligned_block(param, block_start) + offsets,
            aligned_block(grad, block_start) + offsets,
            aligned_block(master, block_start) + offsets,
            (
                aligned_block(states[0], block_start) + offsets,
                aligned_block(states[1], block_start) + offsets,
                aligned_block(states[2], block_start) + offsets,
            ),
        )
    else:
        idx = block_start + offsets
        return param + idx, grad + idx, master + idx, (states[0] + idx, states[1] + idx, states[2] + idx)


@triton.jit
def _scale_rows(scales, block_start, rows, STATE_FORMAT: tl.constexpr, FMT_Q8: tl.constexpr, QUANT_BLOCK: tl.constexpr):
    """8-bit state: pointers to the scales of this block's rows; other formats: the (unused) scale pointers."""
    if STATE_FORMAT == FMT_Q8:
        first = block_start // QUANT_BLOCK
        return scales[0] + first + rows, scales[1] + first + rows, scales[2] + first + rows
    else:
        return scales


@triton.jit
def _update_chunk(
    pointers,
    scales,
    offsets,
    rows,
    start,
    full_end,
    end,
    aligned,
    scalars,
    random_key,
    BLOCK: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    STATE_FORMAT: tl.constexpr,
    FMT_BF16: tl.constexpr,
    FMT_Q8: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,
    RULE: tl.constexpr,
):
    """The update of elements [start, end) of one tensor (`offsets`: 0..BLOCK-1, as [rows, QUANT_BLOCK] for 8-bit
    state): the full blocks up to `full_end` without a mask, with 16-byte alignment hints when every address of
    this tensor allows them (decided per tensor, so one unaligned view does not slow the others); then one
    masked tail."""
    if aligned:
        for block_start in range(start, full_end, BLOCK):
            _update_block(
                _block_pointers(pointers, block_start, offsets, True),
                None,
                scalars,
                _scale_rows(scales, block_start, rows, STATE_FORMAT, FMT_Q8, QUANT_BLOCK),
                None,
                (random_key, block_start + offsets),
                PARAM_DTYPE,
                HAS_MASTER,
                STATE_FORMAT,
                FMT_BF16,
                FMT_Q8,
                RULE,
            )
    else:
        for block_start in range(start, full_end, BLOCK):
            _update_block(
                _block_pointers(pointers, block_start, offsets, False),
                None,
                scalars,
                _scale_rows(scales, block_start, rows, STATE_FORMAT, FMT_Q8, QUANT_BLOCK),
                None,
                (random_key, block_start + offsets),
                PARAM_DTYPE,
                HAS_MASTER,
                STATE_FORMAT,
                FMT_BF16,
                FMT_Q8,
                RULE,
            )
    if full_end < end:
        _update_block(
            _block_pointers(pointers, full_end, offsets, False),
            full_end + offsets < end,
            scalars,
            _scale_rows(scales, full_end, rows, STATE_FORMAT, FMT_Q8, QUANT_BLOCK),
            full_end + rows * QUANT_BLOCK < end,
            (random_key, full_end + offsets),
            PARAM_DTYPE,
            HAS_MASTER,
            STATE_FORMAT,
            FMT_BF16,
            FMT_Q8,
            RULE,
        )


@triton.jit
def _tensor_pointers(
    row,
    grad_address,
    PARAM_DTYPE: tl.constexpr,
    RULE: tl.constexpr,
    STATE_FORMAT: tl.constexpr,
    FMT_BF16: tl.constexpr,
    FMT_Q8: tl.constexpr,
    COL_PARAM: tl.constexpr,
    COL_MASTER: tl.constexpr,
    COL_STATE: tl.constexpr,
    COL_SCALE: tl.constexpr,
):
    """One tensor's pointers from its row of the update table (param, grad, master, and the state slots in the
    state format's dtypes), the 8-bit scales' pointers, and whether all are 16-byte aligned. A slot past the
    rule's count points at slot 0's state: never read or written, it keeps the block calls uniform."""
    param_address = load_address(row + COL_PARAM)
    master_address = load_address(row + COL_MASTER)  # 0 without master weights
    address0 = load_address(row + COL_STATE)
    address1 = address0
    address2 = address0
    if RULE[3] > 1:
        address1 = load_address(row + COL_STATE + 1)
    if RULE[3] > 2:
        address2 = load_address(row + COL_STATE + 2)
    states = (
        moment_pointer(address0, STATE_FORMAT, RULE[4][0], FMT_BF16, FMT_Q8),
        moment_pointer(address1, STATE_FORMAT, RULE[4][1], FMT_BF16, FMT_Q8),
        moment_pointer(address2, STATE_FORMAT, RULE[4][2], FMT_BF16, FMT_Q8),
    )
    pointers = (
        as_pointer(param_address, PARAM_DTYPE),
        as_pointer(grad_address, PARAM_DTYPE),
        as_pointer(master_address, tl.float32),
        states,
    )
    scales = (  # 0 but for 8-bit state
        as_pointer(load_address(row + COL_SCALE), tl.float32),
        as_pointer(load_address(row + COL_SCALE + 1), tl.float32),
        as_pointer(load_address(row + COL_SCALE + 2), tl.float32),
    )
    aligned = is_aligned(param_address | grad_address | master_address | address0 | address1 | address2)
    return pointers, scales, aligned


@triton.jit
def _from_first_element(pointers, start, end, first):
    """A chunk's bounds as its elements' indices in the whole param (`first`: the tensor's first element's,
    sharding.element_offset) and the pointers stepped back by `first`: the loop's index is then the one bf16
    stochastic rounding hashes, the addresses are the same, and no register holds `first` in the loop (one more
    live register made ptxas spill in the bf16 variant)."""
    param, grad, master, states = pointers
    shifted = (param - first, grad - first, master - first, (states[0] - first, states[1] - first, states[2] - first))
    return shifted, start + first, end + first


@triton.jit
def _block_offsets(BLOCK: tl.constexpr, STATE_FORMAT: tl.constexpr, FMT_Q8: tl.constexpr, QUANT_BLOCK: tl.constexpr):
    """A block's element offsets, and its rows: 8-bit state lays a block out as [BLOCK // QUANT_BLOCK,
    QUANT_BLOCK], a row per quantisation block, so a block's scale is a reduction along its row."""
    rows = tl.arange(0, BLOCK // QUANT_BLOCK).to(tl.int64)
    if STATE_FORMAT == FMT_Q8:
        return rows, rows[:, None] * QUANT_BLOCK + tl.arange(0, QUANT_BLOCK).to(tl.int64)[None, :]
    else:
        return rows, tl.arange(0, BLOCK).to(tl.int64)


@triton.jit
def _update_kernel(
    table,  # int64 [num_tensors, TABLE_COLUMNS]
    grad_addrs,  # int64 [num_tensors]
    chunk_tensor,
    chunk_start,
    hparams,  # fp32 [num_groups, H_SIZE]
    fstate,  # fp32: the decision kernel's decisions
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    RULE: tl.constexpr,  # the update rule (`rule_constexpr`)
    STATE_FORMAT: tl.constexpr = state_format.FP32,  # the states' format (state_format.py)
    # the table and buffer layouts and the state formats, as constexpr arguments with defaults: see the module doc
    TABLE_COLUMNS: tl.constexpr = TABLE_COLUMNS,
    COL_PARAM: tl.constexpr = COL_PARAM,
    COL_MASTER: tl.constexpr = COL_MASTER,
    COL_STEP: tl.constexpr = COL_STEP,
    COL_NUMEL: tl.constexpr = COL_NUMEL,
    COL_GROUP: tl.constexpr = COL_GROUP,
    COL_POSITION: tl.constexpr = COL_POSITION,
    COL_FIRST_ELEMENT: tl.constexpr = COL_FIRST_ELEMENT,
    COL_STATE: tl.constexpr = COL_STATE,
    COL_SCALE: tl.constexpr = COL_SCALE,
    F_SKIP: tl.constexpr = layout.F_SKIP,
    H_SIZE: tl.constexpr = H_SIZE,
    FMT_BF16: tl.constexpr = state_format.BF16,
    FMT_Q8: tl.constexpr = state_format.Q8,
    QUANT_BLOCK: tl.constexpr = state_format.QUANT_BLOCK,
    LAYOUT: tl.constexpr = KERNEL_LAYOUT,  # the cache key's share of layout.py (kernels/decide.py says why)
):
    if tl.load(fstate + F_SKIP) == 0.0:  # a skipped step returns before any load: every state stays bit-identical
        pid = tl.program_id(0).to(tl.int64)
        tensor = tl.load(chunk_tensor + pid)
        start = tl.load(chunk_start + pid)
        row = table + tensor * TABLE_COLUMNS
        end = tl.minimum(start + CHUNK, tl.load(row + COL_NUMEL))
        pointers, scales, aligned = _tensor_pointers(
            row,
            load_address(grad_addrs + tensor),
            PARAM_DTYPE,
            RULE,
            STATE_FORMAT,
            FMT_BF16,
            FMT_Q8,
            COL_PARAM,
            COL_MASTER,
            COL_STATE,
            COL_SCALE,
        )
        step = tl.load(tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32)))
        scalars = RULE[0](hparams + tl.load(row + COL_GROUP) * H_SIZE, fstate, step)  # the rule's step_scalars
        random_key = mix32(tl.load(row + COL_POSITION).to(tl.uint32) ^ mix32(step.to(tl.uint32)))  # state_format's
        if STATE_FORMAT == FMT_BF16:  # bf16 stochastic rounding hashes the elements' indices in the whole param
            pointers, start, end = _from_first_element(pointers, start, end, tl.load(row + COL_FIRST_ELEMENT))
        rows, offsets = _block_offsets(BLOCK, STATE_FORMAT, FMT_Q8, QUANT_BLOCK)
        full_end = start + (end - start) // BLOCK * BLOCK
        _update_chunk(
            pointers,
            scales,
            offsets,
            rows,
            start,
            full_end,
            end,
            aligned,
            scalars,
            random_key,
            BLOCK,
            PARAM_DTYPE,
            HAS_MASTER,
            STATE_FORMAT,
            FMT_BF16,
            FMT_Q8,
            QUANT_BLOCK,
            RULE,
        )


def prepare_update(
    *,
    table: torch.Tensor,
    grad_addrs: torch.Tensor,
    chunks: ChunkMap,
    hparams: torch.Tensor,
    fstate: torch.Tensor,
    param_dtype: torch.dtype,
    has_master: bool,
    rule,
    option: bool = False,
    state_format_id: int = state_format.FP32,
    config: LaunchConfig = UPDATE_CONFIG,
) -> tuple[PreparedLaunch, ArgTemplate] | None:
    """The update of every tensor of one param dtype and state format by `rule` (a rules/<rule> package; `option`
    its group option's value, e.g. AdamW's amsgrad), with the decision kernel's clip / skip / lr factor; None when
    there is nothing to update. Addresses that are multiples of 16 bytes get 128-bit accesses,
    per tensor."""
    if param_dtype not in TRITON_DTYPES:
        raise TypeError(f"fused_stable kernels support float32, bfloat16 and float16 params, got {param_dtype}")
    if chunks.num_chunks == 0:
        return None
    if state_format_id == state_format.Q8 and (
        config.block % state_format.QUANT_BLOCK or chunks.chunk_size % config.block
    ):
        # a program's blocks must be whole quantisation blocks, each tensor starting a new one
        raise ValueError(
            f"8-bit state needs a block ({config.block}) that is a multiple of {state_format.QUANT_BLOCK} and a "
            f"chunk ({chunks.chunk_size}) that is a multiple of the block"
        )
    args = ArgTemplate(
        _update_kernel,
        table=table,
        grad_addrs=grad_addrs,
        chunk_tensor=chunks.chunk_tensor,
        chunk_start=chunks.chunk_start,
        hparams=hparams,
        fstate=fstate,
        PARAM_DTYPE=TRITON_DTYPES[param_dtype],
        HAS_MASTER=has_master,
        CHUNK=chunks.chunk_size,
        BLOCK=config.block,
        RULE=rule_constexpr(rule, option),
        STATE_FORMAT=state_format_id,
    )
    return PreparedLaunch(_update_kernel, chunks.num_chunks, config), args


def run_update(prepared: tuple[PreparedLaunch, ArgTemplate], stream) -> None:
    launch, args = prepared
    launch(args.base, stream)
