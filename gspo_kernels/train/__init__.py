"""The toy GSPO / GRPO trainer (``gspo-kernels train``) and its toy tasks."""
