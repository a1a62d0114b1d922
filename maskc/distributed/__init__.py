"""Context parallelism: one attention over a sequence sharded across the ranks of a process group.

plan (plan.py, with layout.py choosing the layout from the mask's block map) → attention
(ring.py: the ring of key shards, merged by LSE, differentiable; agree.py: every rank makes the
call alike, or every rank raises). Built on torch.distributed: NCCL on GPUs, gloo on CPU.

>>> plan = maskc.distributed.plan(maskc.masks.causal, seq_len)
>>> out = maskc.distributed.attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
"""
from maskc.distributed.plan import ContextParallelPlan, plan
from maskc.distributed.ring import attention

__all__ = ["ContextParallelPlan", "attention", "plan"]
