"""Vocabulary-parallel lm_head: 2 and 3 gloo processes started here, against one process.

One spawn per world size runs every case: the cpu, torch and triton (interpreter) backends, padded and
packed layouts, the logits and hidden-state paths, every importance-sampling level and loss type, entropy
and temperature; shards are uneven and (with 3 ranks) not in rank order. Each rank checks its own
results (log-probs, entropy, loss, metrics, dH, its dW / dbias / dlogits shard) against the same backend
run on the whole vocabulary in that process; a failing rank fails the test with its traceback.

The Triton backend runs under the interpreter on a CPU machine (about 5 s a layout per rank): with 2 ranks it
runs the padded layout, with 3 the packed one. The vocabulary-parallel layer (``gspo_kernels.parallel``) is the
same code for every backend and both layouts; what each world size adds (uneven shards, out of rank order with
3) is covered by the cpu and torch backends on both layouts and by Triton on one. verl's Megatron head (Triton,
even shards by rank) runs with 2 ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # the children import triton after this line
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gspo_kernels as gk  # noqa: E402
from tests.support import configs, device_for, rel_err, spawn_within  # noqa: E402

V, H = 37, 16
RANGES = {2: [(0, 15), (15, 37)], 3: [(22, 37), (0, 7), (7, 22)]}  # uneven; 3 ranks out of order
BACKENDS = ("cpu", "torch", "triton")
LENGTHS = (5, 1, 0, 7)
TOL = 2e-5
# A spawn fails past this (a rank hung in a collective): 15 s each alone on the 2-core development machine
SPAWN_TIMEOUT_S = 300
# The interpreter is slow: for triton, a subset of configs() still covering every level, every loss type
# and both paths (index i: level i // 4, loss type i % 4; the hidden-state path when i % 3 == 2).
TRITON_CONFIGS = (0, 5, 10, 11)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gloo_process(rank: int, world: int, port: int):
    """This process as ``rank`` of a gloo group of ``world`` processes (``127.0.0.1:port``) on one CPU thread; the
    group destroyed after."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        yield
    finally:
        dist.destroy_process_group()


def _close(name, got, want, tol=TOL):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = rel_err(got, want)
    assert err < tol, f"{name}: relative error {err:.2e}"


def _layout(packed: bool, gen: torch.Generator):
    if packed:
        N = sum(LENGTHS)
        labels = torch.randint(0, V, (N,), generator=gen)
        cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
        mask = (torch.rand(N, generator=gen) > 0.15).float()
        return labels, mask, cu, (N,), len(LENGTHS)
    B, T = 3, 5
    labels = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor([5, 2, 4])[:, None]).float()
    return labels, mask, None, (B, T), B


def _grads(out_tensors, inputs):
    return torch.autograd.grad(out_tensors, inputs, allow_unused=True, materialize_grads=True)


def _check_logprob_functions(vp, backend, packed, gen):
    s, e = vp.start, vp.end
    labels, _, _, shape, _ = _layout(packed, gen)
    logits = torch.randn(*shape, V, generator=gen) * 2
    w1, w2 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    full = logits.clone().requires_grad_()
    lp, ent = gk.token_logprobs(full, labels, temperature=0.7, return_entropy=True, backend=backend)
    (g_full,) = _grads((lp * w1 + ent * w2).sum(), (full,))
    shard = logits[..., s:e].clone().requires_grad_()
    lp_p, ent_p = gk.token_logprobs(shard, labels, temperature=0.7, return_entropy=True, backend=backend,
                                    vocab_parallel=vp)
    (g_shard,) = _grads((lp_p * w1 + ent_p * w2).sum(), (shard,))
    _close("token_logprobs logp", lp_p, lp)
    _close("token_logprobs entropy", ent_p, ent)
    _close("token_logprobs dlogits shard", g_shard, g_full[..., s:e])

    # -inf on non-label columns (valid input), including rank 1's first column (the stand-in label of
    # the rows whose label lives elsewhere) and a whole shard row of the 3-rank split.
    ninf = torch.full_like(logits[..., 0], float("-inf"))
    logits[..., 15] = torch.where(labels == 15, logits[..., 15], ninf)
    whole = (labels.reshape(-1)[0] < 22) | (labels.reshape(-1)[0] >= 37)
    if whole:
        logits.reshape(-1, V)[0, 22:] = float("-inf")
    full = logits.clone().requires_grad_()
    lp = gk.token_logprobs(full, labels, backend=backend)
    (g_full,) = _grads((lp * w1).sum(), (full,))
    shard = logits[..., s:e].clone().requires_grad_()
    lp_p = gk.token_logprobs(shard, labels, backend=backend, vocab_parallel=vp)
    (g_shard,) = _grads((lp_p * w1).sum(), (shard,))
    with torch.no_grad():
        ent = gk.token_logprobs(logits, labels, return_entropy=True, backend=backend)[1]
        ent_p = gk.token_logprobs(logits[..., s:e], labels, return_entropy=True, backend=backend,
                                  vocab_parallel=vp)[1]
    _close("token_logprobs logp (-inf columns)", lp_p, lp)
    _close("token_logprobs dlogits shard (-inf columns)", g_shard, g_full[..., s:e])
    assert torch.isfinite(lp_p).all() and torch.isfinite(g_shard).all()
    finite = torch.isfinite(ent)  # (the cpu backend's own entropy is inf with -inf columns)
    _close("token_logprobs entropy (-inf columns)", ent_p[finite], ent[finite])
    assert torch.equal(ent_p[~finite], ent[~finite])

    hidden = torch.randn(*shape, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H ** 0.5
    bias = torch.randn(V, generator=gen) * 0.1
    h0, w0, b0 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    lp, ent = gk.linear_logprobs(h0, w0, labels, bias=b0, temperature=1.3, return_entropy=True, backend=backend)
    ref = _grads((lp * w1 + ent * w2).sum(), (h0, w0, b0))
    for reduce in (True, False):
        h1 = hidden.clone().requires_grad_()
        w_s, b_s = weight[s:e].clone().requires_grad_(), bias[s:e].clone().requires_grad_()
        vp_h = vp if reduce else gk.VocabParallel(vp.group, s, e, reduce_hidden_grad=False)
        lp_p, ent_p = gk.linear_logprobs(h1, w_s, labels, bias=b_s, temperature=1.3, return_entropy=True,
                                         backend=backend, vocab_parallel=vp_h)
        dh, dw, db = _grads((lp_p * w1 + ent_p * w2).sum(), (h1, w_s, b_s))
        _close("linear_logprobs logp", lp_p, lp)
        _close("linear_logprobs entropy", ent_p, ent)
        _close("linear_logprobs dW shard", dw, ref[1][s:e])
        _close("linear_logprobs dbias shard", db, ref[2][s:e])
        if reduce:
            _close("linear_logprobs dH (summed over the group)", dh, ref[0])
        else:
            assert rel_err(dh, ref[0]) > 1e-3  # each rank's dH is partial ...
            total = dh.clone()
            dist.all_reduce(total, group=vp.group)
            _close("linear_logprobs dH (partial, summed by hand)", total, ref[0])  # ... and they add up


def _check_losses(vp, backend, packed, gen):
    s, e = vp.start, vp.end
    for i, config in enumerate(configs()):
        if backend == "triton" and i not in TRITON_CONFIGS:
            continue
        labels, mask, cu, shape, S = _layout(packed, gen)
        per_token = i % 2 == 1
        adv = torch.randn(shape if per_token else (S,), generator=gen)
        kw = dict(mask=mask, cu_seqlens=cu, config=config, backend=backend, num_items_in_batch=9,
                  ref_logprobs=torch.randn(shape, generator=gen) * 0.3 - 3.5,
                  is_ratio=1 + 0.1 * torch.rand(shape, generator=gen))
        old = torch.randn(shape, generator=gen) * 0.3 - 3.5
        if i % 3 != 2:  # the logits path for two configs in three, the hidden-state path for the rest
            logits = torch.randn(*shape, V, generator=gen)
            full = logits.clone().requires_grad_()
            want = gk.gspo_loss(full, labels, adv, old, **kw)
            (g_full,) = _grads(want.loss, (full,))
            shard = logits[..., s:e].clone().requires_grad_()
            got = gk.gspo_loss(shard, labels, adv, old, vocab_parallel=vp, **kw)
            (g_shard,) = _grads(got.loss, (shard,))
            grads = [("dlogits shard", g_shard, g_full[..., s:e])]
        else:
            hidden = torch.randn(*shape, H, generator=gen)
            weight = torch.randn(V, H, generator=gen) / H ** 0.5
            h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            want = gk.fused_linear_gspo_loss(h0, w0, labels, adv, old, **kw)
            dh_ref, dw_ref = _grads(want.loss, (h0, w0))
            h1, w_s = hidden.clone().requires_grad_(), weight[s:e].clone().requires_grad_()
            got = gk.fused_linear_gspo_loss(h1, w_s, labels, adv, old, vocab_parallel=vp, **kw)
            dh, dw = _grads(got.loss, (h1, w_s))
            grads = [("dH", dh, dh_ref), ("dW shard", dw, dw_ref[s:e])]
        name = f"{config.importance_sampling_level}/{config.loss_type}"
        assert abs(got.loss.item() - want.loss.item()) <= TOL * max(1.0, abs(want.loss.item())), name
        math_metrics = {k for k in want.metrics if not k.startswith("fused_linear/")}  # not the one-pass diagnostic
        assert set(got.metrics) == math_metrics, name
        for key, value in ((k, want.metrics[k]) for k in math_metrics):
            assert abs(float(got.metrics[key]) - float(value)) <= TOL * max(1.0, abs(float(value))), (name, key)
        for what, g, r in grads:
            _close(f"{name} {what}", g, r)


def _check_bad_input(rank: int, world: int):
    lo, hi = RANGES[world][rank]
    bad = {
        "overlap": {2: [(0, 20), (15, V)], 3: [(22, V), (0, 7), (6, 22)]},
        "gap": {2: [(0, 10), (15, V)], 3: [(22, V), (0, 7), (8, 22)]},
        "end must be > start|invalid range": {2: [(0, 15), (15, 15)], 3: [(22, V), (0, 7), (7, 7)]},
    }
    for message, ranges in bad.items():
        a, b = ranges[world][rank]
        with pytest.raises(ValueError, match=message):
            gk.VocabParallel(None, a, b)
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank builds every group
    with pytest.raises(ValueError, match="size 1 must hold the whole vocabulary"):
        gk.VocabParallel(singles[rank], 3, 10)
    with pytest.raises(TypeError, match="vocab_parallel"):
        gk.token_logprobs(torch.randn(2, V), torch.zeros(2, dtype=torch.long), vocab_parallel=(0, V))
    vp = gk.VocabParallel(None, lo, hi)
    with pytest.raises(ValueError, match="labels must lie in \\[0, 37\\)"):
        gk.token_logprobs(torch.randn(2, hi - lo), torch.tensor([0, V]), vocab_parallel=vp)
    with pytest.raises(ValueError, match="weight holds"):
        gk.linear_logprobs(torch.randn(2, H), torch.randn(hi - lo + 1, H), torch.tensor([0, 1]), vocab_parallel=vp)
    with pytest.raises(ValueError, match="logits holds"):
        gk.gspo_loss(torch.randn(1, 2, V), torch.zeros(1, 2, dtype=torch.long), torch.randn(1), vocab_parallel=vp)


def _check_verl_megatron_head(rank: int, world: int) -> None:
    """verl's vocabulary-parallel Triton head (Megatron path), routed: even shards by rank, dH left partial."""
    from gspo_kernels.integrations import verl as gk_verl

    gen = torch.Generator().manual_seed(5)
    vocab = 36
    local = vocab // world
    hidden = torch.randn(2, 7, H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen) / H ** 0.5
    labels = torch.randint(0, vocab, (2, 7), generator=gen)
    w1, w2 = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = gk.linear_logprobs(h0, w0, labels, temperature=0.9, return_entropy=True)
    dh_ref, dw_ref = _grads((lp * w1 + ent * w2).sum(), (h0, w0))
    h1 = hidden.clone().requires_grad_()
    w_s = weight[rank * local:(rank + 1) * local].clone().requires_grad_()
    lp_p, ent_p = gk_verl.linear_cross_entropy(h1, w_s, labels, 0.9, "none", dist.group.WORLD)
    dh, dw = _grads((lp_p * w1 + ent_p * w2).sum(), (h1, w_s))
    _close("verl head logp", lp_p, lp)
    _close("verl head entropy", ent_p, ent)
    _close("verl head dW shard", dw, dw_ref[rank * local:(rank + 1) * local])
    dist.all_reduce(dh)
    _close("verl head dH (partial, summed by hand)", dh, dh_ref)


def _worker(rank: int, world: int, port: int) -> None:
    with gloo_process(rank, world, port):
        lo, hi = RANGES[world][rank]
        vp = gk.VocabParallel(None, lo, hi)
        assert vp.vocab_size == V
        for backend in BACKENDS:
            device = device_for(backend)  # CUDA tensors for triton / torch where CUDA exists (gloo reduces them)
            for packed in (((world == 3),) if backend == "triton" else (False, True)):
                # the same inputs on every rank: one seed, a generator on the device the tensors are made on
                gen = torch.Generator(device=device).manual_seed(1000 * packed + BACKENDS.index(backend))
                with torch.device(device):
                    _check_logprob_functions(vp, backend, packed, gen)
                    _check_losses(vp, backend, packed, gen)
        if world == 2:
            _check_verl_megatron_head(rank, world)
        _check_bad_input(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_one_process(world):
    spawn_within(_worker, (world, _free_port()), nprocs=world, timeout=SPAWN_TIMEOUT_S)


def test_vocab_parallel_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gk.VocabParallel(None, 0, 10)
    with pytest.raises(TypeError, match="start must be an int"):
        gk.VocabParallel(None, 0.0, 10)
