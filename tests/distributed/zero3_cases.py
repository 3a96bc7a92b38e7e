"""The ZeRO-3 cases of ``test_zero3.py``: a tiny policy, each rank's batches, one training step, and the worker.

Run as a script under ``torchrun --nproc_per_node 2`` (DeepSpeed's CPU accelerator and gloo on a machine without
GPUs), the worker trains every case of :data:`CASES` for :data:`STEPS` steps under DeepSpeed ZeRO-3 with the
lm_head partitioned, and writes what the test checks: the trained parameters (gathered, rank 0), and on each rank the
all-gathers the library ran per call, whether the head was partitioned again after every call, and whether any
storage of the gathered head (or of its cast) outlived the forward call. The test takes the same steps in one
process without DeepSpeed (:func:`train_in_one_process`) and compares.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from typing import Dict, List

import torch
from torch import nn

VOCAB, HIDDEN, STEPS, LR, WORLD = 96, 16, 2, 0.05, 2
BACKENDS = ("torch", "cpu", "triton")
ROUTES = ("loss", "logprobs")  # fused_linear_gspo_loss; linear_logprobs then policy_loss
CONDITIONS = (
    "plain",      # both ranks alike
    "masked",     # rank 1: every token masked
    "uneven",     # rank 0: 2 short responses; rank 1: 7 long ones (more chunks, a tiny memory budget)
    "clipped",    # rank 1: every response clipped at the sequence level (no gradient)
    "zero_adv",   # rank 1: every advantage 0
)
CASES = [(b, r, c) for b in ("torch", "cpu") for r in ROUTES for c in CONDITIONS + ("autocast",)]
# the Triton backend in the interpreter (seconds a case): each route's conditions without gradient on one rank, and
# uneven chunks (rank 0's rows are plain in every case); autocast is left out there (bf16 dots in the interpreter)
CASES += [("triton", "loss", "masked"), ("triton", "loss", "uneven"), ("triton", "logprobs", "clipped"),
          ("triton", "logprobs", "zero_adv")]
# the lm_head tied to the embedding (one parameter, which the embedding's own forward and backward gather too)
CASES += [("torch", "logprobs", "tied"), ("cpu", "loss", "tied")]
EXAMPLE_ROLLOUTS, EXAMPLE_UPDATES = 3, 2
MEMORY_BUDGET = 4096  # bytes: several chunks / tiles per call where a backend reads it


def case_name(case) -> str:
    return "/".join(case)


class TinyPolicy(nn.Module):
    """Embedding, one tanh layer, an lm_head with a bias: ``forward(ids) -> hidden [B, T, H]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(ids)))


def build_policy(tied: bool = False) -> TinyPolicy:
    torch.manual_seed(0)
    model = TinyPolicy()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits that spread (a near-uniform softmax hides mistakes)
        model.lm_head.bias.normal_()
    if tied:
        model.lm_head.weight = model.embed.weight
    return model


def batch(condition: str, rank: int, step: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: token ids, labels, mask, advantages (a different one per rank)."""
    seed = CONDITIONS.index(condition) if condition in CONDITIONS else len(CONDITIONS)  # autocast, tied: as plain
    g = torch.Generator().manual_seed(100 * step + 10 * rank + seed)
    responses, length = (2, 4) if condition == "uneven" and rank == 0 else (7, 9) if condition == "uneven" else (4, 6)
    ids = torch.randint(0, VOCAB, (responses, length), generator=g)
    labels = torch.randint(0, VOCAB, (responses, length), generator=g)
    lengths = torch.randint(1, length + 1, (responses,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).float()
    advantages = torch.randn(responses, generator=g)
    if rank == 1 and condition == "masked":
        mask.zero_()
    if rank == 1 and condition == "zero_adv":
        advantages.zero_()
    # the old policy's log-probs: the current ones shifted per response (some responses clip, some do not)
    shift = 4e-4 * torch.randn(responses, 1, generator=g)
    if rank == 1 and condition == "clipped":  # every response outside the band on the side its advantage clips
        shift = -0.01 * advantages.sign()[:, None]
    return dict(ids=ids, labels=labels, mask=mask, advantages=advantages, shift=shift)


def loss_of(model, lm_head, data, backend: str, route: str, autocast: bool, on_hidden=None) -> torch.Tensor:
    """One rank's loss: the head from the hidden states and the lm_head's weight and bias as they come.
    ``on_hidden(hidden)``: called with the hidden states (the worker hooks their gradient)."""
    import gspo_kernels as gk

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    hidden = model(data["ids"])
    if on_hidden is not None:
        on_hidden(hidden)
    common = dict(bias=lm_head.bias, backend=backend)
    with torch.no_grad(), cast:
        old = gk.linear_logprobs(hidden, lm_head.weight, data["labels"], **common) - data["shift"]
    with cast:
        if route == "loss":
            return gk.fused_linear_gspo_loss(hidden, lm_head.weight, data["labels"], data["advantages"], old,
                                             mask=data["mask"], memory_budget=MEMORY_BUDGET, **common).loss
        logp = gk.linear_logprobs(hidden, lm_head.weight, data["labels"], memory_budget=MEMORY_BUDGET, **common)
    return gk.policy_loss(logp, data["advantages"], old, mask=data["mask"]).loss


def train_in_one_process(case) -> Dict[str, torch.Tensor]:
    """The same steps without DeepSpeed: the mean of the ranks' losses, SGD, the global norm clipped at 1."""
    backend, route, condition = case
    model = build_policy(tied=condition == "tied")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_of(model, model.lm_head, batch(condition, r, step), backend, route, condition == "autocast")
                   for r in range(WORLD)) / WORLD
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class Watch:
    """What the library did with the head in each call on this rank: its all-gathers (forward, backward), the
    head's status after the call, and whether a storage of the gathered head or of its cast outlived the call."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        from gspo_kernels.distributed import zero3

        self.calls: List[dict] = []
        self.gathers: List[int] = []
        self.storages: List[StorageWeakRef] = []
        watch = self
        gather, forward, register_cast = zero3.HeadGather._gather, zero3.HeadGather.forward, zero3.HeadGather.register_cast

        def counted_gather(self):
            done = gather(self)
            watch.gathers.append(int(bool(done)))  # one all-gather for the params missing
            return done

        @contextlib.contextmanager
        def watched_forward(self):
            with forward(self):
                watch.storages += [StorageWeakRef(p.data.untyped_storage()) for p in self.params]
                yield

        def watched_cast(self, param, cast):
            register_cast(self, param, cast)
            if cast is not None and cast is not param:
                watch.storages.append(StorageWeakRef(cast.untyped_storage()))

        zero3.HeadGather._gather = counted_gather
        zero3.HeadGather.forward = watched_forward
        zero3.HeadGather.register_cast = watched_cast

    def start(self) -> None:
        self.gathers, self.storages, self.head_when_body_backward = [], [], None

    def hook_hidden(self, head):
        """A hook on the hidden states' gradient: the body's backward starts after the head's has finished, its
        gradients accumulated; the head's status then."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        def hook(grad):
            self.head_when_body_backward = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in head)

        return lambda hidden: hidden.register_hook(hook)

    def end(self, what: str, head) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if any(not s.expired() for s in self.storages):
            # garbage not yet collected (reference cycles), or gloo's worker thread still holding an all-gather's
            # output for a moment: neither is a reference the library keeps
            gc.collect()
            for _ in range(50):
                if all(s.expired() for s in self.storages):
                    break
                time.sleep(0.02)
        # a storage that is still a parameter's own data (gathered, held by a module: a tied embedding) is DeepSpeed's
        held = {p.data.untyped_storage()._cdata for p in head if p.ds_status == ZeroParamStatus.AVAILABLE}
        self.calls.append(dict(what=what, gathers=self.gathers, head_partitioned_in_body_backward=self.head_when_body_backward,
                               partitioned=all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in head),
                               outlived=sum(not s.expired() and s.cdata not in held for s in self.storages)))


def worker(out_dir: str) -> None:
    from gspo_kernels.testing import setup_triton_interpreter

    setup_triton_interpreter()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    watch = Watch()
    report, states = {}, {}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
    engines = {}
    for case in CASES:
        backend, route, condition = case
        tied = condition == "tied"
        if tied not in engines:
            model = build_policy(tied)
            initial = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            engines[tied] = engine, initial
        engine, initial = engines[tied]
        head = [engine.module.lm_head.weight, engine.module.lm_head.bias]
        # every case from the same weights, in one engine: the parameters loaded, the optimizer's fp32 partitions
        # refreshed from them (SGD keeps no other state)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
            with torch.no_grad():
                for n, p in engine.module.named_parameters():
                    p.copy_(initial[n])
        engine.optimizer.refresh_fp32_params()
        calls = []
        started = time.time()
        for step in range(STEPS):
            watch.calls = calls
            data = batch(condition, rank, step)
            watch.start()
            loss = loss_of(engine, engine.module.lm_head, data, backend, route, condition == "autocast",
                           on_hidden=watch.hook_hidden(head))
            watch.end("forward", head)
            watch.start()
            engine.backward(loss)
            watch.end("backward", head)
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            states[case_name(case)] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        report[case_name(case)] = calls
        if os.environ.get("ZERO3_DEBUG"):
            print("TIME", case_name(case), round(time.time() - started, 2), flush=True)
    # the documented example's loop (examples/deepspeed_zero3.py), in the same processes (not counted)
    watch.start()
    watch.calls = []
    states["example"] = load_example().train(rollouts=EXAMPLE_ROLLOUTS, updates=EXAMPLE_UPDATES)
    with open(os.path.join(out_dir, f"calls{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        torch.save(states, os.path.join(out_dir, "states.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def load_example():
    """``examples/deepspeed_zero3.py`` as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "deepspeed_zero3.py")
    spec = importlib.util.spec_from_file_location("deepspeed_zero3_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    worker(sys.argv[1])
