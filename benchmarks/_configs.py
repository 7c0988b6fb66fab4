"""Hugging Face config fields of the models the GPU benchmarks build with random weights.

One place for the shapes (speed does not depend on the weight values, DEVELOPERS.md); ``family``
names the Transformers class. The tiny entries run the same code paths on the CPU (``--smoke``).
"""

HF_CONFIGS = {
    "llama-3.1-8b": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "qwen2.5-coder-1.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen2.5-coder-0.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        family="qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "tiny-llama": dict(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}
