"""The oracle's own input checks (it shares none with the fast paths): a bad argument raises, naming it."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from gspo_kernels.config import GSPOConfig

Scalar = Union[None, int, float, Tensor]


def _num_items(value: Scalar) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"num_items_in_batch must be an integer or float tensor, got {value.dtype}")
        if value.is_meta:
            raise ValueError("num_items_in_batch is on the meta device: it has no value")
        value = float(value.detach().reshape(()).cpu())
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"num_items_in_batch must be an int, float or scalar tensor, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"num_items_in_batch must be a finite number > 0, got {value!r}")
    return float(value)


def _check_config(config: Optional[GSPOConfig]) -> GSPOConfig:
    if config is None:
        return GSPOConfig()
    if not isinstance(config, GSPOConfig):
        raise TypeError(f"config must be a GSPOConfig, got {type(config).__name__}")
    return config


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")


def _check_integer(name: str, value: object) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_softcap(softcap: Optional[float]) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"final_logit_softcapping must be None or a finite number > 0, got {softcap!r}")


def _check_label_range(labels: Tensor, vocab_size: int, name: str) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary size), got values in "
                         f"[{int(labels.min())}, {int(labels.max())}]")


def _check_linear(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor) -> None:
    _check_float("hidden", hidden)
    _check_float("weight", weight)
    _check_integer("labels", labels)
    want = tuple(labels.shape)
    if hidden.dim() != len(want) + 1 or tuple(hidden.shape[:-1]) != want:
        raise ValueError(f"hidden must have shape {want + ('H',)} to match labels {want}, got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(f"weight must be [V, H] with V >= 1 and H = {hidden.shape[-1]} (hidden's last dimension), "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        _check_float("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
