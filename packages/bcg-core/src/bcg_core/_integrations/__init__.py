"""Model-family adapters that turn a library's attention into break points (transformers'
models and its continuous-batching engine here; diffusers lives in the bcg-diffusion
distribution). Public through ``bcg_core``'s names only.

Uses ``_capture``'s decorator, flag and context, and the runner (continuous batching runs its
forward through one); only ``bench`` sits above it.
"""
