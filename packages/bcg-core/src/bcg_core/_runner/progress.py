"""The progress bar of :meth:`BreakableGraphRunner.capture_many`: tqdm, else rich, else none.

An engine's start-up captures dozens of shapes and takes seconds to minutes; a bar says how far
it is. Neither library is a dependency: the bar is drawn when one is importable and asked for
(by default: when stderr is a terminal, so logs and CI output stay clean).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

Advance = Callable[[str], None]
"""Called once per captured call with a short note (the shape just captured)."""


@contextlib.contextmanager
def capture_progress(total: int, show: bool | None) -> Iterator[Advance]:
    """A bar over ``total`` captures; ``show=None`` shows it when stderr is a terminal."""
    if show is None:
        show = sys.stderr.isatty()
    if not show or total == 0:
        yield _nothing
        return
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        pass
    else:
        with tqdm(total=total, desc="bcg capture", unit="graph", leave=False) as bar:

            def tick(note: str) -> None:
                bar.set_postfix_str(note, refresh=False)
                bar.update(1)

            yield tick
        return
    try:
        from rich.progress import Progress
    except ImportError:
        yield _nothing
        return
    with Progress(transient=True) as progress:
        task = progress.add_task("bcg capture", total=total)
        yield lambda note: progress.update(task, advance=1, description=f"bcg capture {note}")


def _nothing(note: str) -> None:
    """No bar: nothing to draw."""
