"""The backends of the fused step, one module each, behind the one switch in fused_stable.ops:
  - triton_backend: the Triton kernels (fused_stable.kernels), compiled on CUDA or interpreted on CPU;
  - torch_backend: torch's multi-tensor ops, for CPU tensors.
Each takes a StepPlan (fused_stable.plan) and this step's grads, keeps its device side of the plan in
`plan.backend_cache`, and never reads a device value on the host.
"""
