"""bcg-diffusion: breakable CUDA graphs for diffusion transformers."""

from bcg_diffusion._version import __version__

__all__ = ["__version__"]
