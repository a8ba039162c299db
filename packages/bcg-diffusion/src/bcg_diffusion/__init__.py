"""bcg-diffusion: breakable CUDA graphs for diffusion transformers.

Attention ops become eager break points (:func:`make_attention_ops_breakable` for diffusers
models, :func:`install_breakable_attention` for your own attention classes), everything else is
captured, and :class:`DiTRunner` replays one graph per input signature, each replay under
a fresh replay token. See DESIGN.md.
"""

from bcg_core import PatchHandle, patch_attribute  # core's, re-exported for diffusion users
from bcg_diffusion._attention import (
    AttentionPatch,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_breakable_attention_forward,
    uninstall_breakable_attention,
)
from bcg_diffusion._diffusers import make_attention_ops_breakable
from bcg_diffusion._padding import bucket_for, pad_prompt
from bcg_diffusion._runner import DiTRunner
from bcg_diffusion._tokens import get_current_replay_token, replay_token_scope
from bcg_diffusion._version import __version__

__all__ = [
    "AttentionPatch",
    "DiTRunner",
    "PatchHandle",
    "__version__",
    "bucket_for",
    "get_current_replay_token",
    "install_breakable_attention",
    "is_breakable_attention_installed",
    "make_attention_ops_breakable",
    "make_breakable_attention_forward",
    "pad_prompt",
    "patch_attribute",
    "replay_token_scope",
    "uninstall_breakable_attention",
]
