"""gpu-check's memcheck workload: small shapes through every Triton launch (``gspo-kernels gpu-check --workload``)."""

from __future__ import annotations

from typing import Optional, Sequence


def workload(device: str = "cuda", vocab_size: int = 4099, linear_vocab_size: int = 1000,
             loss_types: Optional[Sequence[str]] = None, objectives: bool = True) -> None:
    """Small shapes through every Triton launch of the library (run under ``compute-sanitizer``).

    Logits path: padded ``[:, :-1]`` view (routed to its base), transposed rows, in place, ``-inf`` logits,
    out-of-range labels with the value checks skipped (decision 5: never read), a vocabulary that is not a
    multiple of the block. Hidden-state path: bf16 and fp32 operands, with bias, through the public
    functions; the two-pass backward over one and several vocabulary slices and over rows. Sequence stage: every level and loss type, KL and entropy, and
    with ``objectives``, every objective's Triton helpers (each loss type of the registry, the levels and the
    rollout correction modes in turn) on packed responses with a masked token and an empty one (``--workload``;
    ``--workload-quick`` leaves them out: their compilations would pass the quick step's time). Raises on a
    non-finite loss.
    ``device="cpu"`` runs it in the Triton interpreter (tests).
    """
    import torch

    import gspo_kernels as gk
    from gspo_kernels.backends.triton.logits import logits_logprobs
    from gspo_kernels.config import ALL_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, ROLLOUT_CORRECTIONS
    from gspo_kernels.options import CallOptions

    torch.manual_seed(0)
    B, T, V = 3, 5, vocab_size
    for level in IMPORTANCE_SAMPLING_LEVELS:
        for loss_type in loss_types or LOSS_TYPES:
            for inplace in (False, True):
                model_out = torch.randn(B, T + 1, V, device=device, requires_grad=True) * 1.0  # non-leaf
                labels = torch.randint(0, V, (B, T), device=device)
                config = gk.GSPOConfig(importance_sampling_level=level, loss_type=loss_type,
                                       max_completion_length=T, entropy_coef=0.01, beta=0.04)
                logp_now = gk.token_logprobs(model_out.detach()[:, :-1], labels, backend="triton")
                out = gk.gspo_loss(model_out[:, :-1], labels, torch.randn(B, device=device), logp_now - 1e-3,
                                   ref_logprobs=logp_now + 0.01, config=config, backend="triton",
                                   inplace_backward=inplace)
                out.loss.backward()
                if not torch.isfinite(out.loss):
                    raise RuntimeError(f"non-finite loss ({level}, {loss_type})")
    # Every objective's own Triton helpers (their gradient passes write per token): packed responses of 4, 1, 0 and
    # 6 tokens (one masked), per-token advantages, old and engine log-probs.
    cu = torch.tensor([0, 4, 5, 5, 11], device=device, dtype=torch.int32)
    mask = torch.ones(11, device=device)
    mask[2] = 0
    for i, loss_type in enumerate(ALL_LOSS_TYPES if objectives else ()):
        level = IMPORTANCE_SAMPLING_LEVELS[i % len(IMPORTANCE_SAMPLING_LEVELS)]
        options = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=T,
                       rollout_correction=ROLLOUT_CORRECTIONS[i % len(ROLLOUT_CORRECTIONS)])
        try:
            config = gk.GSPOConfig(**options)
        except ValueError:  # an objective whose epsilon_high is an absolute cap, or that refuses the mode
            options.update(epsilon_high=5.0, rollout_correction=None)
            config = gk.GSPOConfig(**options)
        logp = (torch.randn(11, device=device) - 2).requires_grad_(True)
        old = logp.detach() + 0.05 * torch.randn(11, device=device)
        out = gk.policy_loss(logp, torch.randn(11, device=device), old, mask=mask, cu_seqlens=cu,
                             rollout_logprobs=old + 0.1 * torch.randn(11, device=device), config=config,
                             backend="triton")
        torch.autograd.grad(out.loss, logp)
        if not torch.isfinite(out.loss):
            raise RuntimeError(f"non-finite loss ({level}, {loss_type})")
    x = torch.randn(V, 7, device=device).t().requires_grad_(True)  # transposed rows
    x_inf = torch.randn(7, V, device=device)
    x_inf[:, ::3] = float("-inf")
    labels = torch.tensor([0, 1, -100, V, 4, 5, V - 1], device=device)  # two out of range: never read
    for logits in (x, x_inf.requires_grad_(True)):
        logp, entropy = logits_logprobs(logits, labels, options=CallOptions(return_entropy=True))
        torch.autograd.grad((logp.nan_to_num() + entropy).sum(), logits)
    for dtype in (torch.bfloat16, torch.float32):
        hidden = torch.randn(37, 64, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(linear_vocab_size, 64, device=device) * 0.1).to(dtype).requires_grad_(True)
        bias = torch.randn(linear_vocab_size, device=device, dtype=dtype, requires_grad=True)
        y = torch.randint(0, linear_vocab_size, (37,), device=device)
        logp, entropy = gk.linear_logprobs(hidden, weight, y, bias=bias, return_entropy=True, backend="triton")
        torch.autograd.grad((logp + entropy).sum(), (hidden, weight, bias))
        # the two-pass backward's other forms: over several vocabulary slices (a ragged last one), and over rows
        # (more rows than a quarter of the vocabulary: configs.vocab_sliced)
        row_form = linear_vocab_size // 4 + 8
        for rows, vocab, budget in ((37, 5000, 37 * 2048 * 6), (row_form, linear_vocab_size, None)):
            h = torch.randn(rows, 64, device=device, dtype=dtype, requires_grad=True)
            w = (torch.randn(vocab, 64, device=device) * 0.1).to(dtype).requires_grad_(True)
            lab = torch.randint(0, vocab, (rows,), device=device)
            lp, ent = gk.linear_logprobs(h, w, lab, return_entropy=True, backend="triton", memory_budget=budget)
            torch.autograd.grad((lp + ent).sum(), (h, w))
        out = gk.fused_linear_gspo_loss(hidden[None], weight, y.reshape(1, 37), torch.ones(1, device=device),
                                        backend="triton", config=gk.GSPOConfig(entropy_coef=0.01))
        torch.autograd.grad(out.loss, (hidden, weight))
    if device == "cuda":
        torch.cuda.synchronize()
