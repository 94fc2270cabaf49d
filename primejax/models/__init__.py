"""Flax NNX decoders (Qwen3 / Qwen2 / Llama), HF checkpoint interop, sharding rules and Orbax checkpoints."""
