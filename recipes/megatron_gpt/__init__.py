"""megatron-core GPT recipe: presets cpu-tiny and cpu-3d (CI), gpu-125m, gpu-1.3b and gpu-8b (untested on GPU here)."""
