"""Tiny random ``transformers`` causal LMs of several families and a word-level tokenizer built in code."""

from __future__ import annotations

from typing import List

import torch

WORDS: List[str] = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>", "+", "=", "?"] + [str(d) for d in range(10)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
FAMILIES = ("llama", "qwen2", "qwen3", "gemma")
MORE_FAMILIES = ("mistral", "qwen3_moe")


def word_tokenizer(*, chat: bool = False):
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` (WordLevel model, whitespace split), no downloads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(family: str, tok, *, seed: int = 0, hidden: int = 32, layers: int = 2, lm_head_bias: bool = False):
    """A random causal LM of ``family`` (1-2 layers, hidden 32) sized to ``tok``'s vocabulary, fp32, eval mode."""
    import transformers as tf

    common = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=hidden // 4, tie_word_embeddings=False))
    elif family == "gemma":  # tied lm_head, embeddings scaled by sqrt(hidden)
        model = tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=hidden // 4, tie_word_embeddings=True))
    elif family == "gemma2":  # logits soft-capped: c tanh(lm_head(h) / c), c small enough to bend random logits
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=hidden // 4, tie_word_embeddings=True,
                                                     final_logit_softcapping=0.5))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, head_dim=hidden // 4, tie_word_embeddings=False))
    elif family == "qwen3_moe":  # 4 experts, 2 routed per token, in every layer
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=hidden // 4, moe_intermediate_size=hidden // 2, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False))
    else:
        raise ValueError(f"unknown family {family!r}")
    if lm_head_bias:
        head = model.get_output_embeddings()
        head.bias = torch.nn.Parameter(0.1 * torch.randn(head.out_features))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()
