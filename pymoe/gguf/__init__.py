"""The GGUF file: reading and validating it, the frozen ModelConfig, inspecting it."""
