"""DiTRunner: bcg-core's signature-keyed runner, set up for diffusion transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bcg_core import BreakableGraphRunner
from bcg_diffusion._attention import patch_attention_classes
from bcg_diffusion._patching import PatchHandle
from bcg_diffusion._tokens import replay_token_scope


class DiTRunner(BreakableGraphRunner):
    """Replays a DiT one captured graph per signature, with attention modules as break points.

    On top of :class:`bcg_core.BreakableGraphRunner` (whose rules all apply): the runner holds
    its own reference on the attention patches it is given, released by :meth:`close` (another
    runner patching the same classes keeps its breaks), and every replay runs inside
    :func:`replay_token_scope`, so eager attention code can cache per-replay metadata once and
    reuse it in every layer. Two ways to say what breaks:

    - ``breakable_attention=make_attention_ops_breakable(model)``: every attention op of a
      diffusers transformer (projections stay captured); the runner owns the handle;
    - ``attention_classes=(MyAttention,)``: each class's ``forward`` (or a processor class's
      ``__call__``) is one break.

    Typical use::

        runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model))
        for latents, t, text in warmup_shapes:
            runner.capture(latents, t, text)      # one graph per resolution / prompt bucket
        for step in range(50):
            noise = runner(latents, t, text)      # replays; unknown shapes run eagerly

    Args:
        model: the diffusion transformer (or any callable) to stand in for.
        attention_classes: classes whose attention method becomes one break each (default:
            none); patched when the runner is made.
        breakable_attention: a handle from :func:`make_attention_ops_breakable`, which the
            runner then owns and releases on :meth:`close` (default None).
        **runner_options: keyword arguments of :class:`bcg_core.BreakableGraphRunner`
            (``device``, ``max_entries``, ``as_tensor`` ...); ``replay_context`` defaults to
            :func:`replay_token_scope`.

    Raises:
        TypeError: ``breakable_attention`` is not a :class:`PatchHandle`, an attention class
            has no ``forward`` or ``__call__``, or as in :class:`bcg_core.BreakableGraphRunner`.
        ValueError: as in :class:`bcg_core.BreakableGraphRunner`.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        attention_classes: tuple[type, ...] = (),
        breakable_attention: PatchHandle | None = None,
        **runner_options: Any,
    ) -> None:
        if breakable_attention is not None and not isinstance(breakable_attention, PatchHandle):
            raise TypeError(
                "breakable_attention takes the handle make_attention_ops_breakable(model) "
                f"returns, got {breakable_attention!r}"
            )
        try:
            runner_options.setdefault("replay_context", replay_token_scope)
            super().__init__(model, **runner_options)
            patches = [patch_attention_classes(*attention_classes)]
        except BaseException:
            # The runner owns the handle it was given: a runner that was never made releases it.
            if breakable_attention is not None:
                breakable_attention.remove()
            raise
        if breakable_attention is not None:
            patches.append(breakable_attention)
        self._patches: list[PatchHandle] = patches

    def close(self) -> None:
        """Drop all graphs and release this runner's attention patches (idempotent).

        Patches that other runners or :func:`install_breakable_attention` hold stay in place.
        """
        self.reset()
        patches, self._patches = self._patches, []
        for patch in patches:
            patch.remove()
