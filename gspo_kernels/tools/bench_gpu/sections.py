"""The in-process sections (hidden, logits, torch-backend) and the entry point of a section subprocess."""

from __future__ import annotations

import json
import sys
from typing import Callable, Dict, List, Optional, Tuple

from gspo_kernels.tools.peers import peer

from .measure import (
    _Ctx,
    _environment,
    _gpu_clocks,
    _rel_err,
    _run_case,
    issue_ms,
    kernel_ms,
    sync_count,
    time_steps,
)
from .plan import PEERS, Skip, gspo_formula

# --- the hidden-state section ------------------------------------------------------------------------------


def section_hidden(ctx: _Ctx) -> None:
    import gspo_kernels as gk

    torch, s, dev = ctx.torch, ctx.shape, ctx.device
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    B, T, H, V = s["B"], s["T"], s["H"], s["V"]
    N = B * T
    ctx.emit("hidden", "environment", status="info", environment=_environment(ctx))

    # Ceilings: bare cuBLAS bf16 GEMMs.
    def gemm_square():
        n = s["gemm"]
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        r = time_steps(ctx, lambda: a @ b, warmup=3, reps=10)
        return dict(r, tflops=2 * n**3 / (r["ms"] * 1e-3) / 1e12, n=n)

    gemm = _run_case(ctx, "hidden", "ceiling: cuBLAS bf16 GEMM n^3", gemm_square)
    peak_tflops = gemm.get("tflops") if gemm and gemm.get("status") == "ok" else None

    gen = torch.Generator(device=dev).manual_seed(0)  # on the device: 0.6 G weights drawn on the host take seconds
    hidden = (torch.randn(B, T, H, generator=gen, device=dev) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device=dev) * H**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=dev)
    mask = torch.ones(B, T, device=dev)
    adv_all = torch.randn(B, generator=torch.Generator().manual_seed(0)).abs() + 0.5
    adv_all[1::2] *= -1
    adv_half = adv_all.clone()
    adv_half[0::2] = 0.0  # half the responses at zero advantage
    adv_all, adv_half = adv_all.to(dev), adv_half.to(dev)
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels).float()  # on-policy: every weight ~1, nothing clipped
    leaves = (hidden, weight)
    flops6 = 6.0 * N * H * V

    def zero_grads():
        for leaf in leaves:
            leaf.grad = None

    def gemm_shape():
        h2 = hidden.detach().reshape(N, H)
        w = weight.detach()
        r = time_steps(ctx, lambda: h2 @ w.t(), warmup=2, reps=5)
        limit = f"; 6NHV at the n^3 rate: {flops6 / (peak_tflops * 1e12) * 1e3:.1f} ms" if peak_tflops else ""
        return dict(r, tflops=2.0 * N * H * V / (r["ms"] * 1e-3) / 1e12, bare_gemms_6nhv_ms=3 * r["ms"],
                    limit_6nhv_ms=flops6 / (peak_tflops * 1e12) * 1e3 if peak_tflops else None,
                    note=f"hidden @ weight.T, bf16 out; x3 (the three GEMMs of 6NHV): {3 * r['ms']:.1f} ms{limit}")

    _run_case(ctx, "hidden", "ceiling: cuBLAS hidden @ weight.T at the shape", gemm_shape)
    for h_size in chunk_gemm_hidden_sizes(H, tiny=ctx.tiny):
        _run_case(ctx, "hidden", f"ceiling: chunk GEMM by rows, H={h_size}",
                  lambda h_size=h_size: chunk_gemm_sweep(ctx, N, h_size, V, dtype, peak_tflops))

    def plain_step(adv):
        def step():
            logits = hidden @ weight.t()
            logp = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
            del logits
            loss = gspo_formula(logp, old, adv, mask)
            loss.backward()
            return loss
        return step

    def ours_step(adv):
        def step():
            loss = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask).loss
            loss.backward()
            return loss
        return step

    def with_rate(r: Dict) -> Dict:
        r["tflops"] = flops6 / (r["ms"] * 1e-3) / 1e12
        if peak_tflops:
            r["of_gemm_ceiling"] = r["tflops"] / peak_tflops
        return r

    ref: Dict[str, object] = {}

    def plain(adv, keep: bool):
        def fn():
            r = with_rate(time_steps(ctx, plain_step(adv), zero_grads))
            if keep:  # plain PyTorch's gradients: the reference of ours' dH / dW
                ref["dh"], ref["dw"] = hidden.grad.detach().clone(), weight.grad.detach().clone()
            zero_grads()
            return r
        return fn

    def ours(adv, full: bool):
        def fn():
            step = ours_step(adv)
            r = with_rate(time_steps(ctx, step, zero_grads))
            if full and ctx.cuda:
                r["clocks_after_timed_steps"] = _gpu_clocks(ctx)
            if full:
                if "dh" in ref:
                    r["dh_rel_err_vs_plain"] = _rel_err(hidden.grad, ref["dh"])
                    r["dw_rel_err_vs_plain"] = _rel_err(weight.grad, ref["dw"])
                r["kernel_ms"] = kernel_ms(ctx, step, zero_grads, record=r)
                if r["kernel_ms"] is not None:
                    r["wall_minus_kernel_ms"] = r["ms"] - r["kernel_ms"]
                    r["kernel_share_of_wall"] = r["kernel_ms"] / r["ms"]
                r.update(issue_ms(ctx, step, zero_grads))
                r["sync_ops_per_call"] = sync_count(ctx, step, zero_grads)
            zero_grads()
            return r
        return fn

    _run_case(ctx, "hidden", "plain PyTorch, all rows", plain(adv_all, keep=True))
    _run_case(ctx, "hidden", "ours fused_linear_gspo_loss, all rows", ours(adv_all, full=True))
    ref.clear()
    _run_case(ctx, "hidden", "plain PyTorch, half zero advantage", plain(adv_half, keep=False))
    _run_case(ctx, "hidden", "ours fused_linear_gspo_loss, half zero advantage", ours(adv_half, full=False))

    _hidden_peers(ctx, hidden=hidden, weight=weight, labels=labels, mask=mask, old=old, adv_all=adv_all,
                  zero_grads=zero_grads, with_rate=with_rate)


# The chunk GEMM (``chunked_gemm.chunk_logits``: ``hidden[:m] @ weight.T`` written as fp32 into the chunk buffer) at the
# row counts the library's chunk rules give and their neighbours that are multiples of 128: whether a row count
# that is not a multiple of cuBLAS's tile costs its padding (the sliced route's forward runs 432-row GEMMs at the
# TRL client's shape, the no-grad pass 1760-row ones). H = 2048 is the TRL client's hidden size.
CHUNK_GEMM_ROWS = (384, 512, 1024, 1536, 1664, 1792)
CHUNK_GEMM_TINY_ROWS = (8, 16, 24, 32)


def chunk_gemm_hidden_sizes(H: int, tiny: bool) -> Tuple[int, ...]:
    return (H,) if tiny else tuple(dict.fromkeys((H, 2048)))


def chunk_gemm_rows(N: int, V: int, dtype, tiny: bool) -> List[int]:
    """The sweep's row counts: the library's own chunk rows at ``(N, V)`` (the no-grad pass, the vocabulary-sliced
    route's forward) and :data:`CHUNK_GEMM_ROWS`, at most ``N``."""
    from gspo_kernels.backends.triton import configs

    own = [configs.gemm_chunk_rows(N, V, dtype, budget, need_dz=False)
           for budget in (None, configs.VOCAB_SLICE_BUDGET)]
    fixed = CHUNK_GEMM_TINY_ROWS if tiny else CHUNK_GEMM_ROWS
    return sorted({m for m in (*own, *fixed) if 0 < m <= N})


def chunk_gemm_sweep(ctx: _Ctx, N: int, H: int, V: int, dtype, peak_tflops: Optional[float]) -> Dict:
    """TFLOP/s of the library's chunk GEMM for each row count of :func:`chunk_gemm_rows` (one row of the table;
    ``sweep``: rows -> TFLOP/s, ``ms`` the largest count's)."""
    from gspo_kernels.backends.triton.chunked_gemm import chunk_logits

    torch, dev = ctx.torch, ctx.device
    rows = chunk_gemm_rows(N, V, dtype, ctx.tiny)
    gen = torch.Generator(device=dev).manual_seed(1)
    h = (torch.randn(max(rows), H, generator=gen, device=dev) * 0.5).to(dtype)
    w = (torch.randn(V, H, generator=gen, device=dev) * H**-0.5).to(dtype)
    out = torch.empty(max(rows), V, device=dev, dtype=torch.float32)
    sweep, last = {}, None
    for m in rows:
        last = time_steps(ctx, lambda m=m: chunk_logits(h[:m], w, None, out), warmup=2, reps=5)
        sweep[m] = 2.0 * m * H * V / (last["ms"] * 1e-3) / 1e12
    best = max(sweep.values())
    note = ", ".join(f"{m}: {t:.0f}" for m, t in sweep.items())
    return dict(last, tflops=sweep[max(rows)], sweep=sweep, H=H,
                of_gemm_ceiling=sweep[max(rows)] / peak_tflops if peak_tflops else None,
                note=f"TFLOP/s by rows (fp32 out, V = {V}): {note}; best {best:.0f}")


def _timed(ctx: _Ctx, step: Callable, zero_grads: Callable, complete: Callable[[Dict], Dict],
           timing: Optional[Dict] = None, **fields) -> Dict:
    """``step``'s timing (``time_steps`` with ``timing``), completed by ``complete`` (the section's rates) and
    ``fields``; the gradients zeroed after."""
    r = complete(time_steps(ctx, step, zero_grads, **(timing or {})))
    r.update(fields)
    zero_grads()
    return r


def _hidden_peers(ctx: _Ctx, *, hidden, weight, labels, mask, old, adv_all, zero_grads, with_rate) -> None:
    """The hidden-state section's peers on the same inputs (all rows counted): TRL's chunked log-probs,
    Cut Cross-Entropy and Liger, each with the GSPO formula in PyTorch, and the no-grad forward pass."""
    import gspo_kernels as gk

    torch = ctx.torch
    (B, T), H = labels.shape, hidden.shape[-1]
    N = B * T

    def trl_chunk_size() -> int:
        try:
            from trl.trainer import utils as trl_utils
            return int(getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768))
        except Exception:
            return 32768

    def trl_logp(fn, chunk: int):
        return fn.apply(hidden.reshape(N, H), weight, None, labels.reshape(N), 1.0, chunk, None, 1.0, ())[0]

    def trl_fwd_bwd():
        fn, chunk = peer("trl.kernels", "ChunkedLogProbFunction"), trl_chunk_size()

        def step():
            logp = trl_logp(fn, chunk).reshape(B, T)
            loss = gspo_formula(logp, old, adv_all, mask)
            loss.backward()
            return loss
        return _timed(ctx, step, zero_grads, with_rate, chunk_size=chunk)

    _run_case(ctx, "hidden", "TRL ChunkedLogProbFunction + GSPO formula, all rows", trl_fwd_bwd, peer="trl")

    def cce():
        if not ctx.cuda:
            raise Skip("Cut Cross-Entropy's kernels need CUDA")
        linear_cross_entropy = peer("cut_cross_entropy", "linear_cross_entropy")

        def step():
            nll = linear_cross_entropy(hidden.reshape(N, H), weight, labels.reshape(N), reduction="none")
            loss = gspo_formula(-nll.float().reshape(B, T), old, adv_all, mask)
            loss.backward()
            return loss
        return _timed(ctx, step, zero_grads, with_rate,
                      note="cross-entropy log-probs (default impl and filter) + the GSPO formula in PyTorch")

    _run_case(ctx, "hidden", "Cut Cross-Entropy linear_cross_entropy + GSPO formula", cce, peer="cce")

    # The two-pass head with autograd (the TRL drop-in's route and verl's): the log-probs, the GSPO formula in
    # PyTorch, the backward (over vocabulary slices here: V >= 4 N).
    def two_pass():
        def step():
            logp = gk.linear_logprobs(hidden, weight, labels)
            loss = gspo_formula(logp, old, adv_all, mask)
            loss.backward()
            return loss
        return _timed(ctx, step, zero_grads, with_rate)

    _run_case(ctx, "hidden", "ours linear_logprobs + autograd (two pass) + GSPO formula, all rows", two_pass)

    # The two-pass forward (no grad): the old / reference log-prob pass.
    def fwd_ours():
        with torch.no_grad():
            return time_steps(ctx, lambda: gk.linear_logprobs(hidden, weight, labels))

    def fwd_trl():
        fn, chunk = peer("trl.kernels", "ChunkedLogProbFunction"), trl_chunk_size()
        with torch.no_grad():
            return time_steps(ctx, lambda: trl_logp(fn, chunk))

    _run_case(ctx, "hidden", "forward: ours linear_logprobs (no grad)", fwd_ours)
    _run_case(ctx, "hidden", "forward: TRL ChunkedLogProbFunction (no grad)", fwd_trl, peer="trl")

    def liger():
        cls = peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
        loss_fn = cls(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=3e-4, epsilon_high=4e-4,
                      loss_type="grpo", importance_sampling_level="sequence")

        def step():
            out = loss_fn(hidden, weight, labels, mask, adv_all, old_per_token_logps=old)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss
        return _timed(ctx, step, zero_grads, with_rate, dict(warmup=1, reps=2),
                      note="eager (compiled=False), 1 warm-up + 2 timed")

    _run_case(ctx, "hidden", "Liger LigerFusedLinearGRPOLoss (sequence), all rows", liger,
              need_s=0 if ctx.tiny else 20.0, peer="liger")


# --- the logits section ------------------------------------------------------------------------------------


def _copy_bandwidth(ctx: _Ctx) -> Dict:
    torch = ctx.torch
    n = ctx.shape["copy_mib"] * 2**20 // 2
    src = torch.randn(n, device=ctx.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    r = time_steps(ctx, lambda: dst.copy_(src), warmup=3, reps=10)
    return dict(r, tb_s=2 * src.numel() * 2 / (r["ms"] * 1e-3) / 1e12, bytes=2 * src.numel() * 2,
                note="device-to-device copy, bytes read + written")


def _logits_inputs(ctx: _Ctx, B: int, T: int, V: int, seed: int = 0):
    import gspo_kernels as gk

    torch = ctx.torch
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    logits = (torch.randn(B, T + 1, V, generator=gen, device=ctx.device) * 2).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=ctx.device)
    adv = torch.randn(B, generator=gen, device=ctx.device)
    mask = torch.ones(B, T, device=ctx.device)
    with torch.no_grad():
        old = gk.token_logprobs(logits.detach()[:, :-1], labels).float()
    return logits, labels, adv, old, mask


def _logits_steps(logits, labels, adv, old, mask, **loss_options) -> Tuple[Callable, Callable, Callable]:
    """``(zero_grads, ours, plain)`` on logits ``[B, T + 1, V]`` (the last position dropped, as a model's
    shifted output): one loss + backward step of ``gspo_loss`` (with ``loss_options``) and of plain PyTorch."""
    import gspo_kernels as gk

    def zero_grads():
        logits.grad = None

    def ours():
        loss = gk.gspo_loss(logits[:, :-1], labels, adv, old, mask=mask, **loss_options).loss
        loss.backward()
        return loss

    def plain():
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        loss = gspo_formula(logp, old, adv, mask)
        loss.backward()
        return loss

    return zero_grads, ours, plain


def section_logits(ctx: _Ctx) -> None:
    s = ctx.shape
    copy = _run_case(ctx, "logits", "ceiling: device-to-device copy", lambda: _copy_bandwidth(ctx))
    tb_s = copy.get("tb_s") if copy and copy.get("status") == "ok" else None
    for V in (s["V"], s["V_small"]):
        _logits_vocab(ctx, V, tb_s)
        ctx.clean()


def _logits_vocab(ctx: _Ctx, V: int, tb_s: Optional[float]) -> None:
    """The logits section's cases at one vocabulary size."""
    B, T = ctx.shape["B"], ctx.shape["T"]
    logits, labels, adv, old, mask = _logits_inputs(ctx, B, T, V)
    itemsize = logits.element_size()
    floor_bytes = 3.0 * B * T * V * itemsize
    floor_ms = floor_bytes / (tb_s * 1e12) * 1e3 if tb_s else None

    zero_grads, ours_step, plain_step = _logits_steps(logits, labels, adv, old, mask)

    def with_floor(r: Dict) -> Dict:
        r.update(floor_ms=floor_ms, floor_bytes=floor_bytes, V=V)
        if floor_ms:
            r["of_floor"] = floor_ms / r["ms"]
        return r

    def ours():
        r = with_floor(time_steps(ctx, ours_step, zero_grads))
        r["kernel_ms"] = kernel_ms(ctx, ours_step, zero_grads, record=r)
        if r["kernel_ms"] is not None:
            r["wall_minus_kernel_ms"] = r["ms"] - r["kernel_ms"]
        r.update(issue_ms(ctx, ours_step, zero_grads))
        r["sync_ops_per_call"] = sync_count(ctx, ours_step, zero_grads)
        zero_grads()
        return r

    def plain():
        return _timed(ctx, plain_step, zero_grads, with_floor)

    def liger():
        if not ctx.cuda:
            raise Skip("Liger's triton_grpo_loss needs CUDA")
        fn = peer("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")

        def step():
            loss = fn(logits, old, None, labels, adv, mask, temperature=1.0, beta=0.0, eps_low=3e-4,
                      eps_high=4e-4, inplace=False, loss_type="grpo", importance_sampling_level="sequence",
                      reduce=True)[0]
            loss.backward()
            return loss
        return _timed(ctx, step, zero_grads, with_floor, note="reads [B, T+1, V] and shifts itself; not in place")

    _run_case(ctx, "logits", f"ours gspo_loss, V={V}", ours)
    _run_case(ctx, "logits", f"plain PyTorch, V={V}", plain)
    _run_case(ctx, "logits", f"Liger triton_grpo_loss (sequence), V={V}", liger, peer="liger")


# --- backend="torch" on CUDA ------------------------------------------------------------------------------


def section_torch_backend(ctx: _Ctx) -> None:
    _torch_backend_logits(ctx)
    ctx.clean()
    _torch_backend_hidden(ctx)


def _torch_backend_logits(ctx: _Ctx) -> None:
    sl = ctx.shape["torch_logits"]
    logits, labels, adv, old, mask = _logits_inputs(ctx, sl["B"], sl["T"], sl["V"], seed=1)

    zero_logits, ours_logits, plain_logits = _logits_steps(logits, labels, adv, old, mask, backend="torch")

    _torch_backend_pair(ctx, f"logits [{sl['B']}, {sl['T'] + 1}, {sl['V']}]", ours_logits, plain_logits, zero_logits)


def _torch_backend_pair(ctx: _Ctx, shape: str, ours: Callable, plain: Callable, prepare: Callable) -> None:
    """``backend="torch"`` and plain PyTorch at one shape of the torch-backend section: one warm-up, 3 timed steps."""
    for label, step in ((f"ours backend='torch', {shape}", ours), (f"plain PyTorch, {shape}", plain)):
        _run_case(ctx, "torch-backend", label,
                  lambda step=step: dict(time_steps(ctx, step, prepare, warmup=1, reps=3), shape=shape))


def _torch_backend_hidden(ctx: _Ctx) -> None:
    import gspo_kernels as gk

    torch = ctx.torch
    sh = ctx.shape["torch_hidden"]
    B, T, H, V = sh["B"], sh["T"], sh["H"], sh["V"]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    hidden = (torch.randn(B, T, H, generator=gen, device=ctx.device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device=ctx.device) * H**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=ctx.device)
    adv = torch.randn(B, generator=gen, device=ctx.device)
    mask = torch.ones(B, T, device=ctx.device)
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels).float()

    def zero_hidden():
        hidden.grad = weight.grad = None

    def ours_hidden():
        loss = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend="torch").loss
        loss.backward()
        return loss

    def plain_hidden():
        logp = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        loss = gspo_formula(logp, old, adv, mask)
        loss.backward()
        return loss

    _torch_backend_pair(ctx, f"hidden N={B * T}, H={H}, V={V}", ours_hidden, plain_hidden, zero_hidden)


SECTION_FUNCS = {"hidden": section_hidden, "logits": section_logits, "torch-backend": section_torch_backend}


def _section_main() -> None:
    """Entry point of a section subprocess: the spec (JSON) on stdin, one result line per case on stdout.
    ``spec["sections"]``: the sections to run in this process, in order (one on a GPU; all of them in a
    ``--tiny`` smoke run, which saves the interpreter starts)."""
    spec = json.loads(sys.stdin.read())
    ctx = _Ctx(spec["device"], spec["tiny"], spec["deadline"], spec.get("peers", PEERS))
    for section in spec["sections"]:
        SECTION_FUNCS[section](ctx)
        ctx.clean()
