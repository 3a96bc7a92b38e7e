"""Training: :class:`GSPOTrainer` for any Hugging Face causal LM (:mod:`gspo_kernels.train.hf_trainer`), and
the toy trainer ``gspo-kernels train`` on toy tasks (:mod:`gspo_kernels.train.toy_trainer`)."""

from gspo_kernels.train.hf_trainer import GSPOTrainer, GSPOTrainerConfig
from gspo_kernels.train.model_parts import UnsupportedModelError

__all__ = ["GSPOTrainer", "GSPOTrainerConfig", "UnsupportedModelError"]
