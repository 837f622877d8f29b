"""Small model configs (Hugging Face config.json values) for the engine's tests."""

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    vocab_size=320,
    torch_dtype="float32",
)

QWEN2 = dict(
    SMALL, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False
)
QWEN3 = dict(
    SMALL,
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    attention_bias=False,
    tie_word_embeddings=True,
    num_key_value_heads=1,
)
PHI3 = dict(
    SMALL,
    architectures=["Phi3ForCausalLM"],
    model_type="phi3",
    rms_norm_eps=1e-5,
    partial_rotary_factor=0.75,
    tie_word_embeddings=False,
)
"""Phi-4-mini's shape: q/k/v and gate/up fused in the checkpoint, three quarters of each head
turned by the rotary (its LM head is tied; an untied one here keeps random weights from
echoing the last token, so greedy tokens tell a wrong rope apart)."""
