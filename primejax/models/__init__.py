"""Model families (Flax NNX), HF weight conversion, and tiny test-model builders."""
