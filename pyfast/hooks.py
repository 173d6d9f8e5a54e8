"""Compression for users who keep torch's DistributedDataParallel:

    ddp.register_comm_hook(CompressionState("int8"), compression_hook)

Works on gloo and NCCL alike (torch's own quantization hooks are CUDA-only): the reduction is
pyfast.comm.all_reduce, run on pyfast's communication thread; DDP waits on the future.
"""
import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast.comm import all_reduce
from pyfast.comm.collectives import wait_all


class CompressionState:
    """State of compression_hook: the compressor, its error-feedback memory (per bucket) and
    the iteration count. For the first `start_iter` iterations gradients are reduced
    uncompressed (as torch's PowerSGD state does), letting training settle first."""

    def __init__(self, spec="int8", process_group=None, start_iter: int = 0,
                 error_feedback: bool = True):
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        base = C.get(spec)
        lossy = base.spec not in ("none", "fp16", "bf16")
        self.compressor = C.WithFeedback(base) if error_feedback and lossy else base
        self.process_group, self.start_iter, self.iter = process_group, start_iter, 0
        self._seen: set[str] = set()

    def state_dict(self) -> dict:
        return {"spec": self.compressor.spec, "iter": self.iter,
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["spec"] != self.compressor.spec:
            raise ValueError(f"state is for {state['spec']!r}, not {self.compressor.spec!r}")
        self.iter = int(state["iter"])
        self.compressor.load_state_dict(state["compressor"])


def _prune(state: CompressionState) -> None:
    fb = getattr(state.compressor, "feedback", None)
    if fb is not None:
        for key in [k for k in fb.memory if k.split(".")[0] not in state._seen]:
            del fb.memory[key]
    state._seen = set()


# no `from __future__ import annotations`: DDP checks these annotations as objects
def compression_hook(state: CompressionState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    # DDP rebuilds its buckets once, after the first iteration, so an index can change size:
    # the size is part of the key, and keys of buckets that no longer exist are dropped.
    name = f"bucket{bucket.index()}:{buf.numel()}"
    c = state.compressor if state.iter >= state.start_iter else None
    state._seen.add(name)
    if bucket.is_last():
        state.iter += 1
        _prune(state)
    fut = torch.futures.Future()
    if c is not None and isinstance(getattr(c, "inner", c), C.PowerSGD):
        grads = [g.view(p.shape) for g, p in zip(bucket.gradients(), bucket.parameters())]
        handles = [all_reduce(g, c, state.process_group, op="avg", async_op=True,
                              name=f"{name}.{i}") for i, g in enumerate(grads)]
    else:
        handles = [all_reduce(buf, c, state.process_group, op="avg", async_op=True, name=name)]

    def done(_):
        try:
            wait_all(handles)
            fut.set_result(buf)
        except BaseException as e:
            fut.set_exception(e)
    handles[-1]._fut.add_done_callback(done)
    return fut
