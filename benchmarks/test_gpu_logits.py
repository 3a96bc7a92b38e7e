"""GPU benchmark of the logits path: forward + backward of ``gspo_loss`` at N = 16384, V = 151936, bf16.

Run on a CUDA machine with ``python -m pytest benchmarks/test_gpu_logits.py --benchmark-only``; skipped
with a reason elsewhere. Never run on the development machines of this project (no GPU).

What is measured: one training step's loss work, from bf16 logits ``[B, T+1, V]`` (a model's output, read
through ``logits[:, :-1]`` where the implementation allows it) to the logits gradient, with a synchronize at
the end. The Triton backend recognises the ``[:, :-1]`` view and writes the ``[B, T+1, V]`` gradient itself
(zeros at the last position), so autograd's ``slice_backward`` buffer is not part of its time or memory. Bytes: the 3-pass floor ``3 * N * V * 2`` (forward read, backward read, gradient write), so
``GB/s = 3 * N * V * 2 / time``; on an H100 SXM the floor is 3 * 4.98 GB / 3.35 TB/s = 4.5 ms. Every
response carries gradient in the headline case (no clipping, no zero advantage), so no row is skipped;
``test_triton_backward_active_rows`` shows what skipping zero-gradient rows saves (100/50/25% active). Each result row records the
device, torch / triton versions, milliseconds, GB/s and the fraction of 3.35 TB/s.

Compared: ``backend="triton"`` (out of place and ``inplace_backward``), ``backend="torch"`` (the chunked
portable path), TRL's ``selective_log_softmax`` + the PyTorch sequence stage, Liger's ``triton_grpo_loss``
(GSPO via ``importance_sampling_level="sequence"``), flash-attn's Triton cross-entropy (log-probs only,
on a contiguous ``[N, V]`` copy, as it cannot read ``logits[:, :-1]``), and the float64 reference when
the GPU has the memory for it.

``test_triton_gspo_loss_gpt2_vocabulary``: the same step at GPT-2's ``V = 50257`` (``V % 16 != 0``: each row
starts at its own offset modulo 16 bytes; the kernels read an aligned body with 128-bit loads and a masked
edge), against its own 3-pass floor, so that the unaligned case can be compared with the aligned one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU benchmark: no CUDA device on this machine"),
]

B, T, V = 16, 1024, 151936
N = B * T
HBM_PEAK = 3.35e12  # H100 SXM HBM3 bytes/s
FLOOR_BYTES = 3 * N * V * 2  # bf16 forward read + backward read + gradient write
EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _device_info() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "N": N, "V": V, "dtype": "bf16", "floor_bytes": FLOOR_BYTES}


@pytest.fixture(scope="module")
def problem():
    """bf16 logits [B, T+1, V], labels, advantages (one per response, |A| > 0) and near-on-policy old logprobs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(B, T + 1, V, device="cuda", generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    mask = torch.ones(B, T, device="cuda")
    adv = torch.randn(B, device="cuda", generator=gen).sign() * (0.5 + torch.rand(B, device="cuda", generator=gen))
    with torch.no_grad():
        from gspo_kernels import token_logprobs

        now = token_logprobs(master[:, :-1], labels, backend="triton")
    old = now - 1e-5  # every response inside the clip band: all rows carry gradient
    return {"master": master, "labels": labels, "mask": mask, "adv": adv, "old": old}


def _record(benchmark, name: str, floor_bytes: int = FLOOR_BYTES, vocab: int = V) -> None:
    stats = benchmark.stats.stats
    seconds = stats.median
    info = _device_info()
    info.update(case=name, ms=seconds * 1e3, GB_s=floor_bytes / seconds / 1e9, V=vocab, floor_bytes=floor_bytes,
                fraction_of_hbm_peak=floor_bytes / seconds / HBM_PEAK, floor_ms=floor_bytes / HBM_PEAK * 1e3)
    benchmark.extra_info.update(info)
    print(f"\n{name}: {info['ms']:.2f} ms, {info['GB_s']:.0f} GB/s over the 3-pass floor "
          f"({100 * info['fraction_of_hbm_peak']:.1f}% of 3.35 TB/s) on {info['device']}")


def _bench(benchmark, problem, step):
    """Time ``step(logits)`` on a fresh copy of the logits each round (in-place paths consume them)."""
    logits = torch.empty_like(problem["master"])

    def setup():
        with torch.no_grad():
            logits.copy_(problem["master"])
        logits.grad = None
        torch.cuda.synchronize()
        return (logits,), {}

    def run(x):
        step(x)
        torch.cuda.synchronize()

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1, iterations=1)


def _gspo_step(problem, backend: str, inplace: bool = False, adv=None):
    from gspo_kernels import GSPOConfig, gspo_loss

    config = GSPOConfig(importance_sampling_level="sequence", loss_type="grpo", epsilon_low=EPS_LOW,
                        epsilon_high=EPS_HIGH)

    def step(logits):
        x = logits.requires_grad_(True)
        out = gspo_loss(x[:, :-1], problem["labels"], problem["adv"] if adv is None else adv, problem["old"],
                        mask=problem["mask"], config=config, backend=backend, inplace_backward=inplace)
        out.loss.backward()

    return step


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_triton_gspo_loss(benchmark, problem, inplace):
    _bench(benchmark, problem, _gspo_step(problem, "triton", inplace))
    _record(benchmark, f"gspo_kernels triton ({'inplace' if inplace else 'out of place'})")


GPT2_V = 50257


@pytest.fixture(scope="module")
def gpt2_problem():
    """The headline problem at GPT-2's vocabulary (not a multiple of 16)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    master = torch.randn(B, T + 1, GPT2_V, device="cuda", generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, GPT2_V, (B, T), device="cuda", generator=gen)
    adv = torch.randn(B, device="cuda", generator=gen).sign() * (0.5 + torch.rand(B, device="cuda", generator=gen))
    with torch.no_grad():
        from gspo_kernels import token_logprobs

        now = token_logprobs(master[:, :-1], labels, backend="triton")
    return {"master": master, "labels": labels, "mask": torch.ones(B, T, device="cuda"), "adv": adv,
            "old": now - 1e-5}


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_triton_gspo_loss_gpt2_vocabulary(benchmark, gpt2_problem, inplace):
    _bench(benchmark, gpt2_problem, _gspo_step(gpt2_problem, "triton", inplace))
    _record(benchmark, f"gspo_kernels triton, V = {GPT2_V} ({'inplace' if inplace else 'out of place'})",
            floor_bytes=3 * N * GPT2_V * 2, vocab=GPT2_V)


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25], ids=["active100", "active50", "active25"])
def test_triton_backward_active_rows(benchmark, problem, share):
    """Only ``share`` of the responses carry gradient (the others: zero advantage, as a group with equal
    rewards has): their rows are never read in the backward. The floor still counts every row."""
    adv = problem["adv"].clone()
    adv[int(B * share):] = 0.0
    _bench(benchmark, problem, _gspo_step(problem, "triton", True, adv))
    _record(benchmark, f"gspo_kernels triton (inplace, {100 * share:.0f}% of rows active)")
    benchmark.extra_info["active_share"] = share


def test_torch_backend(benchmark, problem):
    _bench(benchmark, problem, _gspo_step(problem, "torch"))
    _record(benchmark, "gspo_kernels torch backend")


def test_trl_selective_log_softmax(benchmark, problem):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from gspo_kernels import GSPOConfig
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs
    from gspo_kernels.objectives.stage import gspo_objective

    config = GSPOConfig(importance_sampling_level="sequence", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    inputs = prepare_loss_inputs(problem["labels"], V, LossTensors(problem["adv"], old_logprobs=problem["old"],
                                 mask=problem["mask"]))

    def step(logits):
        x = logits.requires_grad_(True)
        logp = trl_utils.selective_log_softmax(x[:, :-1], problem["labels"]).float().reshape(-1)
        gspo_objective(logp, None, inputs, config).loss.backward()

    _bench(benchmark, problem, step)
    _record(benchmark, "TRL selective_log_softmax + PyTorch sequence stage")


def test_liger_triton_grpo_loss(benchmark, problem):
    liger = pytest.importorskip("liger_kernel.transformers.grpo_loss")

    def step(logits):
        x = logits.requires_grad_(True)
        loss, _ = liger.triton_grpo_loss(x, problem["old"], None, problem["labels"], problem["adv"],
                                         problem["mask"], temperature=1.0, beta=0.0, eps_low=EPS_LOW,
                                         eps_high=EPS_HIGH, inplace=True, loss_type="grpo",
                                         importance_sampling_level="sequence", reduce=True)
        loss.backward()

    _bench(benchmark, problem, step)
    _record(benchmark, "Liger triton_grpo_loss (sequence level, inplace)")


def test_flash_attn_cross_entropy(benchmark, problem):
    fa = pytest.importorskip("flash_attn.ops.triton.cross_entropy")
    flat = problem["master"][:, :-1].reshape(N, V)  # a contiguous copy: its kernel needs [N, V] rows
    labels = problem["labels"].reshape(N)
    weights = torch.randn(N, device="cuda")
    logits = torch.empty_like(flat)

    def setup():
        with torch.no_grad():
            logits.copy_(flat)
        logits.grad = None
        torch.cuda.synchronize()
        return (logits,), {}

    def run(x):
        losses, _ = fa.cross_entropy_loss(x.requires_grad_(True), labels, inplace_backward=True)
        (losses * weights).sum().backward()  # -logp per token, a per-token weight like dL/dlogp
        torch.cuda.synchronize()

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1, iterations=1)
    _record(benchmark, "flash-attn triton cross_entropy_loss (log-probs only, contiguous copy, inplace)")


def test_float64_reference(benchmark, problem):
    free, _ = torch.cuda.mem_get_info()
    need = 6 * N * V * 8  # float64 logits, log-softmax, probabilities, gradients
    if free < need:
        pytest.skip(f"the float64 reference needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    from gspo_kernels import GSPOConfig, reference

    config = GSPOConfig(importance_sampling_level="sequence", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)

    def step(logits):
        x = logits.requires_grad_(True)
        reference.gspo_loss(x[:, :-1], problem["labels"], problem["adv"], problem["old"], mask=problem["mask"],
                            config=config).loss.backward()

    _bench(benchmark, problem, step)
    _record(benchmark, "gspo_kernels.reference (float64)")
