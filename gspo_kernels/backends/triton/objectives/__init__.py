"""Each objective's Triton helpers for the sequence kernel, one module per objective (``clipped``, ``sapo``,
``cispo``, ``vespo``, ``gmpo``)."""
