"""The toy transformers config that the layer-level parity tests share (reference, our layers,
vLLM's layer), so that all three compare against the same transformers model. Import after
`pytest.importorskip("transformers.models.qwen4_exp")`."""

from __future__ import annotations

from transformers import Qwen4ExpTextConfig

EOS = 7


def tiny_config(**overrides) -> Qwen4ExpTextConfig:
    """A valid Qwen4ExpTextConfig with toy sizes (PLE needs linear_attention layers and EOS)."""
    fields = dict(
        vocab_size=128,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        hc_count=3,
        hc_lowrank=5,
        ple_layer_ids=[1, 2],
        ple_embed_dim=16,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        seed=42,
        eos_token_id=EOS,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=4,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        layer_types=["linear_attention", "linear_attention"],
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return Qwen4ExpTextConfig(**fields)
