"""DiTRunner: bcg-core's signature-keyed runner, set up for diffusion transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bcg_core import BreakableGraphRunner
from bcg_diffusion._attention import AttentionPatch, install_breakable_attention
from bcg_diffusion._tokens import replay_token_scope


class DiTRunner(BreakableGraphRunner):
    """Replays a DiT one captured graph per signature, with attention modules as break points.

    On top of :class:`bcg_core.BreakableGraphRunner` (whose rules all apply): the given attention
    classes are adapted with :func:`install_breakable_attention` (undone by :meth:`close`), and
    every replay runs inside :func:`replay_token_scope`, so eager attention code can cache
    per-replay metadata once and reuse it in every layer. Typical use::

        runner = DiTRunner(model, attention_classes=(MyAttention,))
        for latents, t, text in warmup_shapes:
            runner.capture(latents, t, text)      # one graph per resolution / prompt bucket
        for step in range(50):
            noise = runner(latents, t, text)      # replays; unknown shapes run eagerly
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        attention_classes: tuple[type, ...] = (),
        **runner_options: Any,
    ) -> None:
        runner_options.setdefault("replay_context", replay_token_scope)
        super().__init__(model, **runner_options)
        self._patch: AttentionPatch | None = install_breakable_attention(*attention_classes)

    def close(self) -> None:
        """Drop all graphs and undo the attention patch."""
        self.reset()
        if self._patch is not None:
            self._patch.remove()
            self._patch = None
