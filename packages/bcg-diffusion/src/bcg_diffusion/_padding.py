"""Prompt padding: variable-length text embeddings padded up to a fixed set of bucket lengths.

Each distinct prompt length is a distinct signature, so serving arbitrary prompts would capture
without end. Padding to the nearest bucket makes every prompt hit one of a few captured graphs;
the mask marks the padding so cross-attention ignores it, and the output equals the unpadded
eager output within floating-point tolerance.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length``.

    Args:
        length: the prompt length.
        buckets: the allowed padded lengths, in any order.

    Returns:
        The smallest bucket >= ``length``.

    Raises:
        ValueError: ``buckets`` is empty or holds a length that is no integer (a bool or a
            float is none; NumPy's and 0-dim integer tensors are) or below 1,
            ``length`` is below 1 (or NaN), or it exceeds the largest bucket (the message names it).
        TypeError: ``buckets`` is not a collection, or ``length`` is not a number.
    """
    # A float (16.0) or bool bucket failed later inside F.pad with a TypeError naming neither.
    # Integers of another type (NumPy's, a 0-dim integer tensor) are lengths too: the
    # isinstance(int) check refused np.arange(64, 257, 64) as "not positive int lengths".
    if not isinstance(buckets, Iterable):  # list() raised "'int' object is not iterable"
        raise TypeError(f"buckets takes a collection of lengths, e.g. (64, 128), got {buckets!r}")
    given: list[Any] = list(buckets)
    ordered = sorted(_length(b, given) for b in given)
    if not ordered or ordered[0] < 1:
        raise ValueError(f"buckets must be positive int lengths, got {given}")
    try:
        counted = length >= 1  # (not `length < 1`: a NaN length came back as the smallest bucket)
    except TypeError:  # "'>=' not supported between instances of 'str' and 'int'"
        raise TypeError(f"length must be a number of tokens (an int), got {length!r}") from None
    if not counted:
        # Padding it gives an all-False mask: attention over no key is NaN.
        raise ValueError(f"a prompt must hold at least one token, got length {length}")
    i = bisect.bisect_left(ordered, length)
    if i == len(ordered):
        raise ValueError(
            f"prompt length {length} exceeds the largest bucket {ordered[-1]}; add a larger "
            "bucket or truncate the prompt"
        )
    return ordered[i]


def _length(bucket: Any, buckets: list[Any]) -> int:
    """A bucket as a Python int (any integer type but bool); ValueError for anything else."""
    if not isinstance(bucket, bool):
        try:
            return operator.index(bucket)
        except TypeError:
            pass
    raise ValueError(f"buckets must be positive int lengths, got {buckets}")


def pad_prompt(
    embeds: torch.Tensor, mask: torch.Tensor | None, buckets: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a prompt's embeddings and mask up to the nearest bucket length.

    Args:
        embeds: text embeddings ``[B, L, D]``.
        mask: boolean ``[B, L]``, True for real tokens; None means all True.
        buckets: the allowed padded lengths (see :func:`bucket_for`).

    Returns:
        ``(embeds, mask)`` of shapes ``[B, bucket, D]`` and ``[B, bucket]``: padded positions
        are zeros with mask False. At an exact bucket length the inputs come back as they are
        (the mask as bool).

    Raises:
        ValueError: ``embeds`` is not 3-D, ``mask`` is not ``[B, L]``, ``L`` is 0, or no
            bucket holds ``L`` (see :func:`bucket_for`).
        TypeError: ``embeds`` or ``mask`` is not a tensor, or ``buckets`` not a collection.
    """
    if not isinstance(embeds, torch.Tensor) or not (mask is None or isinstance(mask, torch.Tensor)):
        raise TypeError(
            "pad_prompt takes tensors: embeds [batch, length, dim] and mask [batch, length] (or "
            f"None), got {type(embeds).__name__} and {type(mask).__name__}"
        )
    if embeds.dim() != 3:
        raise ValueError(f"embeds must be [batch, length, dim], got shape {tuple(embeds.shape)}")
    b, length, _ = embeds.shape
    if mask is None:
        mask = torch.ones(b, length, dtype=torch.bool, device=embeds.device)
    elif mask.shape != (b, length):
        raise ValueError(f"mask must be [batch, length] = {(b, length)}, got {tuple(mask.shape)}")
    target = bucket_for(length, buckets)
    pad = target - length
    if pad == 0:
        return embeds, mask.to(torch.bool)
    padded = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
    padded_mask = torch.nn.functional.pad(mask.to(torch.bool), (0, pad), value=False)
    return padded, padded_mask
