"""The Llama family (Llama, Qwen2, Qwen3, Mistral): its parameter names and shapes, its
tensor-parallel plan, its pipeline stages, and how the parallelisms are applied to it."""
