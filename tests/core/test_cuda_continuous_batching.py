"""transformers' continuous batching through bcg on CUDA: the CPU module's mixed prefill+decode
batches (tiny Llama, float32, greedy), bcg's tokens equal the eager engine's, one graph per
query bucket; and the KV read inside the break is the batch's true length (never padded), while
the graphs themselves hold nothing of the KV length (one graph per query bucket)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from test_cpu_continuous_batching import (
    check_against_eager,
    check_kv_reads,
    make_model,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_mixed_batches_equal_eager_token_for_token(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_against_eager(make_model(attention, device="cuda"), monkeypatch)


def test_kv_read_is_never_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    check_kv_reads(make_model(device="cuda"), monkeypatch)
