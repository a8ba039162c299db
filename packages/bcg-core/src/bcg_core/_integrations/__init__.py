"""Model-family adapters that turn a library's attention into break points (transformers here;
diffusers lives in the bcg-diffusion distribution). Public through ``bcg_core``'s names only.

Uses ``_capture``'s public pieces (breaks, flag, context).
"""
