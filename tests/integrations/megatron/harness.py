"""Megatron-core on this CPU: the tests' process setup, a tiny ``GPTModel`` and the multi-process launch.

Two things in megatron-core 0.16.1 hard-code CUDA; :func:`cpu_bypasses` replaces them **in the test processes only**
(never in the library): ``torch.cuda.current_device`` (read by attention's global memory buffer, RoPE and the
sequence-parallel gather / scatter buffers) returns the CPU device, and the CUDA RNG tracker is replaced by
megatron's inference tracker (dropout is 0 in every model built here). Megatron's pipeline schedules still need
CUDA: the tests call the model and the loss directly.

A test module runs all its checks in one launch (:func:`run_ranks`): each rank runs a module-level function that
returns a dict of results; the launch returns every rank's dict, and the test functions assert on them. One launch
costs the import of megatron in each process (a few seconds on the development machine).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import warnings
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from tests.support import spawn_within

# A launch fails past this (a rank hung in a collective): the checks of one module take well under a minute alone
# on the 2-core development machine; the margin covers the suite's other worker.
LAUNCH_TIMEOUT_S = 300


def cpu_bypasses() -> None:
    """Let megatron-core run on CPU tensors in this process: ``torch.cuda.current_device`` returns the CPU device
    and megatron's RNG tracker is the inference one (no CUDA RNG state). Call after ``initialize_model_parallel``."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: torch.device("cpu")
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def megatron_process(rank: int, world: int, port: int, *, tp: int = 1, cp: int = 1):
    """This process as ``rank`` of a gloo group of ``world`` processes with megatron's parallel state initialized
    (tensor-parallel size ``tp``, context-parallel size ``cp``, the rest data parallel) and the CPU bypasses on;
    everything torn down after."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        cpu_bypasses()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def tiny_gpt(*, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, seq_len: int = 16,
             tied: bool = False, params_dtype: torch.dtype = torch.float32, seed: int = 0,
             sequence_parallel: bool = False, init_std: float = 0.5):
    """A tiny megatron ``GPTModel`` (local layer spec, RoPE, dropout 0) with weights drawn from ``seed`` on the CPU
    (identical on every rank before the tensor-parallel split). ``vocab`` is the model's (padded) vocabulary size;
    ``tied``: the output layer uses the word embedding's weight. ``init_std``: megatron's ``init_method_std``
    (0.5, not its 0.02, so that the logits spread over several units and the softmax is far from uniform). Call inside :func:`megatron_process`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=_tp_size(), context_parallel_size=_cp_size(),
        sequence_parallel=sequence_parallel, transformer_impl="local", init_method_std=init_std,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq_len, position_embedding_type="rope",
                     share_embeddings_and_output_weights=tied, parallel_output=True)
    return model.to(params_dtype)


def gpt_inputs(batch: int, seq_len: int, vocab: int, seed: int = 1):
    """``(input_ids [B, S], position_ids [B, S], attention_mask [B, 1, S, S], labels [B, S])`` for :func:`tiny_gpt`,
    the same on every rank: random ids, the next token as the label, megatron's causal mask (True = masked; the
    model's default mask would be built on CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    position_ids = torch.arange(seq_len)[None].expand(batch, seq_len)
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None].expand(batch, 1, -1, -1)
    return tokens[:, :-1].contiguous(), position_ids, mask, tokens[:, 1:].contiguous()


def column_parallel_head(vocab: int, hidden: int, *, sequence_parallel: bool = False,
                         params_dtype: torch.dtype = torch.float32, seed: int = 0):
    """A megatron ``ColumnParallelLinear`` output layer ``[vocab / tp, hidden]`` (no bias, ``gather_output=False``),
    weights from ``seed`` (the full matrix the same on every rank, each rank holding its rows)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=_tp_size(),
                               use_cpu_initialization=True,
                               params_dtype=params_dtype, tensor_model_parallel_size=_tp_size(),
                               sequence_parallel=sequence_parallel, transformer_impl="local")
    return ColumnParallelLinear(hidden, vocab, config=config, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=False, skip_bias_add=False)


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _cp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def _rank_entry(rank: int, fn: Callable, world: int, port: int, outdir: str, tp: int, cp: int, args: tuple) -> None:
    # megatron's notes on this machine (no Apex / Transformer Engine, CUDA-only tuning hints) are not the test's
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    with megatron_process(rank, world, port, tp=tp, cp=cp):
        result = fn(rank, *args)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable, *args, world: int = 2, tp: int = 2, cp: int = 1,
              timeout: float = LAUNCH_TIMEOUT_S) -> List[Optional[dict]]:
    """``fn(rank, *args)`` (a module-level function) in ``world`` gloo processes with megatron's parallel state
    (:func:`megatron_process`); returns each rank's result (picklable, e.g. a dict of measured errors) in rank
    order. A rank that raises or hangs past ``timeout`` fails the caller's test."""
    with tempfile.TemporaryDirectory() as outdir:
        spawn_within(_rank_entry, (fn, world, free_port(), outdir, tp, cp, args), nprocs=world, timeout=timeout)
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
