"""bcg-core: breakable CUDA graphs for PyTorch."""

from bcg_core._version import __version__

__all__ = ["__version__"]
