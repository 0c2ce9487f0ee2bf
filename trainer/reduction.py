"""ZeRO stage 0's gradient all-reduce hidden behind backward (``gradient_reduction: overlapped``).

DeepSpeed reduces stage 0's gradients only after backward has finished, as one all-reduce with nothing to hide it
behind. Here the gradients go in buckets, each all-reduced asynchronously (gloo on CPUs, NCCL on GPUs) as soon as
backward has produced the last of them at the step's last micro-batch; the step waits for them before the optimizer
takes them. Buckets follow the order backward produces gradients (the last layers first) and close at
``bucket_elements``; the sum is divided by the ranks after it, as DeepSpeed does, so that the weights are stage 0's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as torch_dist

log = logging.getLogger(__name__)


class OverlappedReduction:
    """The engine's own reduction turned off, and the buckets' hooks on its parameters. ``start(boundary)`` before each
    backward, ``finish()`` after the step's last (``trainer.step.train_step`` does both)."""

    def __init__(self, engine: Any, *, bucket_elements: int) -> None:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        for p in reversed(params):  # backward produces the last layers' gradients first
            if self.buckets[-1] and sum(q.numel() for q in self.buckets[-1]) >= bucket_elements:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ranks = engine.dp_world_size
        self.active = False
        self.pending: list[int] = []
        self.works: dict[int, tuple[torch.Tensor, Any]] = {}  # bucket -> (its flat gradients, the all-reduce)
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)
        engine.enable_backward_allreduce = False

    def start(self, *, boundary: bool) -> None:
        """Before a backward: at the step's last micro-batch (``boundary``) its gradients are reduced as they come."""
        self.active = boundary
        if boundary:
            self.pending = [len(bucket) for bucket in self.buckets]
            self.works = {}

    def _ready(self, param: torch.nn.Parameter) -> None:
        if not self.active:
            return
        index = self.bucket_of[id(param)]
        self.pending[index] -= 1
        if self.pending[index] == 0:
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        for p in bucket:  # a weight backward did not reach: zeros, as DeepSpeed gives it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self.works[index] = (flat, torch_dist.all_reduce(flat, async_op=True))

    def finish(self) -> None:
        """Wait for every bucket (sending, in order, those backward left incomplete), then the mean over the ranks in
        the parameters' gradients."""
        self.active = False
        for index in range(len(self.buckets)):
            if index not in self.works:
                self._launch(index)
        for index, (flat, work) in sorted(self.works.items()):
            work.wait()
            flat.mul_(1.0 / self.ranks)
            offset = 0
            for p in self.buckets[index]:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.works = {}
