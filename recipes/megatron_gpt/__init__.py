"""megatron-core GPT recipe: presets cpu-tiny (CI), gpu-125m and gpu-1b (untested on GPU here)."""
