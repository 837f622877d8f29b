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
GEMMA2 = dict(
    SMALL,
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=24,
    sliding_window=12,
    attn_logit_softcapping=1.5,
    final_logit_softcapping=4.0,
    tie_word_embeddings=False,
)
"""Gemma 2's shape: sandwich norms, a window in every other layer (the first), scores scaled
by ``query_pre_attn_scalar`` (not head_dim) and soft-capped. The caps are far below Gemma 2's
50 and 30, so that random weights' small scores feel them."""
GEMMA3 = dict(
    SMALL,
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=32,
    sliding_window=12,
    sliding_window_pattern=2,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    tie_word_embeddings=True,
    num_key_value_heads=1,
)
"""Gemma 3's: q/k norms, sliding layers turned by a rope of their own (theta 1e4) and full ones
by a scaled one (theta 1e6, linear x8, as the 4B-27B models' text configs say), a tied head
read from the unscaled embedding, one KV head (as Gemma 3 1B)."""
GRANITE = dict(
    SMALL,
    architectures=["GraniteForCausalLM"],
    model_type="granite",
    embedding_multiplier=2.0,
    attention_multiplier=0.5,
    residual_multiplier=3.0,
    logits_scaling=0.5,
    tie_word_embeddings=False,
)
"""Granite's shape: the embeddings, the attention scores (in place of 1 / sqrt(head_dim)) and
each residual branch times a multiplier, the logits divided by one. Granite 3's are 12, 1/128,
0.22 and 8; these make random weights' greedy tokens tell each one apart (the logits' divisor
only their logprobs: ``test_granite.py``)."""
GRANITEMOE = dict(
    GRANITE,
    architectures=["GraniteMoeForCausalLM"],
    model_type="granitemoe",
    intermediate_size=64,
    num_local_experts=6,
    num_experts_per_tok=2,
)
"""GraniteMoE's: Granite's multipliers (the residual one on the experts' sum too) over 6
experts, 2 per token, weighted by a softmax over their two scores; all of a layer's experts in
one checkpoint tensor (``input_linear``, ``output_linear``)."""
SMOLLM3 = dict(
    SMALL,
    architectures=["SmolLM3ForCausalLM"],
    model_type="smollm3",
    no_rope_layers=[1, 0],
    tie_word_embeddings=False,
)
"""SmolLM3's shape: Llama whose NoPE layers turn neither q nor k. SmolLM3-3B's are every fourth
(``no_rope_layers``' 0s); here the second of two, against the default list's none (an interval
of 4), so greedy tokens tell rope everywhere, or skipped in the wrong layer, apart."""
OLMO2 = dict(
    SMALL,
    architectures=["Olmo2ForCausalLM"],
    model_type="olmo2",
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
"""OLMo 2's shape: no norm before the attention or the MLP, each one's output normed before
its residual add, q and k normed over the whole projection (the generated heads' sizes differ,
so a norm per head would give other tokens)."""
OLMO3 = dict(
    OLMO2,
    architectures=["Olmo3ForCausalLM"],
    model_type="olmo3",
    num_key_value_heads=1,
    sliding_window=12,
    layer_types=["sliding_attention", "full_attention"],
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)
"""OLMo 3's: OLMo 2's layers, a window in the sliding layer (the first; OLMo 3 slides in three
of every four), and YaRN's rope on the full layer only (as OLMo 3's long-context configs say),
one KV head (shared by 2 ranks under tensor parallelism)."""
EXAONE4 = dict(
    SMALL,
    architectures=["Exaone4ForCausalLM"],
    model_type="exaone4",
    rms_norm_eps=1e-5,
    sliding_window=12,
    sliding_window_pattern=2,
    tie_word_embeddings=False,
)
"""EXAONE 4's shape: OLMo's norms (after each block, none before), q and k normed per head,
local layers that slide and turn the rope and global ones that do neither (EXAONE 4 32B: three
local, then a global; here ``sliding_window_pattern`` 2 makes the first local and the second
global, with no ``layer_types`` given)."""
SEED_OSS = dict(
    SMALL,
    architectures=["SeedOssForCausalLM"],
    model_type="seed_oss",
    attention_bias=True,
    attention_out_bias=True,
    tie_word_embeddings=False,
)
"""Seed-OSS's shape: Llama with biases on q/k/v (``attention_bias``) and, here, on o_proj
(``attention_out_bias``, which Seed-OSS-36B leaves off)."""
GLM = dict(
    SMALL,
    architectures=["GlmForCausalLM"],
    model_type="glm",
    partial_rotary_factor=0.5,
    attention_bias=True,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
"""GLM-4's shape (glm-4-9b-chat-hf): half of each head turned by an interleaved rotary (pairs
2i, 2i + 1, GPT-J's layout), q/k/v biases (none on o_proj), gate/up fused in the checkpoint."""
GLM4 = dict(GLM, architectures=["Glm4ForCausalLM"], model_type="glm4")
"""GLM-4-0414's: GLM's layers with sandwich norms (``post_self_attn_layernorm``,
``post_mlp_layernorm``, and ``post_attention_layernorm`` before the MLP)."""
ERNIE4_5 = dict(
    SMALL,
    architectures=["Ernie4_5ForCausalLM"],
    model_type="ernie4_5",
    use_bias=True,
    tie_word_embeddings=False,
)
"""ERNIE 4.5's shape (0.3B): every head turned whole by an interleaved rotary, and here
``use_bias``: biases on q/k/v, o_proj and the MLP (the 0.3B has none)."""
MINISTRAL = dict(
    SMALL,
    architectures=["MinistralForCausalLM"],
    model_type="ministral",
    sliding_window=12,
    layer_types=["sliding_attention", "full_attention"],
    tie_word_embeddings=False,
)
"""Ministral-8B-2410's shape: Mistral whose window slides in the layers ``layer_types`` names
(here the first of two)."""
MINISTRAL3 = dict(
    SMALL,
    architectures=["Ministral3ForCausalLM"],
    model_type="ministral3",
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
    tie_word_embeddings=False,
)
"""Ministral 3's (the text model of Ministral-3-3B/8B/14B): Mistral with YaRN, and Llama 4's
query scale past its original context, which is where Conveyor stops serving it (512 here)."""
HELIUM = dict(
    SMALL,
    architectures=["HeliumForCausalLM"],
    model_type="helium",
    num_attention_heads=4,
    num_key_value_heads=4,
    attention_bias=True,
    mlp_bias=True,
    rms_norm_eps=1e-8,
    tie_word_embeddings=False,
)
"""Kyutai's Helium: a Llama turning q and k in the interleaved layout, with norms that scale in
float32 and round once, and here biases on q/k/v (none on o_proj) and the MLP."""
MIXTRAL = dict(
    SMALL,
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=None,
    tie_word_embeddings=False,
)
"""Mixtral's shape: every layer's MLP is 4 experts of the dense width, 2 per token, their
weights renormalised over the two."""
QWEN3_MOE = dict(
    SMALL,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=48,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    tie_word_embeddings=False,
)
"""Qwen3-MoE's: q/k norms, 8 narrow experts, 3 per token, and a dense MLP in layer 1
(``mlp_only_layers``), so both kinds of layer run."""
QWEN2_MOE = dict(
    SMALL,
    architectures=["Qwen2MoeForCausalLM"],
    model_type="qwen2_moe",
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=96,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    tie_word_embeddings=False,
)
"""Qwen2-MoE's: q/k/v biases, 6 experts, 2 per token with their softmax weights as they are
(not renormalised), and a shared expert under a sigmoid gate."""
