"""A stand-in for ring-flash-attn (tests only; see the README.md above): OpenRLHF's ``unpad_and_slice_tensor``
hands it each micro-batch's ``cu_seqlens`` under a ring-attention group. Here attention stays local to each rank's
slice (the tests compare two heads over the same model call, not the attention)."""

__version__ = "0.0.0+gspo-kernels-test-stub"


def update_ring_flash_attn_params(cu_seqlens, process_group) -> None:
    """Ring flash attention's per-batch parameters: nothing to keep here."""


def substitute_hf_flash_attn(process_group, heads_k_stride) -> None:
    raise RuntimeError("ring-flash-attn is a test stand-in here (tests/integrations/stubs/ring_flash_attn)")
