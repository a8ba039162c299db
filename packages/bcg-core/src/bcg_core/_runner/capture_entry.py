"""One capture of a runner: static buffers for the call, warm-ups and the capture on the pool's
lane, and the :class:`Entry` that replays it. The runner decides what a failure means (block
the signature, renew the pool); this module only guarantees that a failed capture leaves
nothing behind."""

from __future__ import annotations

import time
from typing import Any

import torch

from bcg_core import _trees
from bcg_core._backends import GraphBackend
from bcg_core._capture.capture import internal_capture
from bcg_core._capture.flag import enable_breakable_cuda_graph
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._capture.modes import autocast_state
from bcg_core._errors import CaptureError
from bcg_core._runner.calls import Call
from bcg_core._runner.entry import Entry
from bcg_core._runner.overlap import OverlapCheck
from bcg_core._runner.pool import PoolTurn
from bcg_core._runner.scalars import ScalarSlots
from bcg_core._signature import (
    call_objects,
    identity_objects,
    object_tensors,
    static_buffer,
    static_call,
)


def capture_entry(
    module: Any,
    call: Call,
    lifted: Call,
    live: list[torch.Tensor],
    values: list[Any],
    *,
    backend: GraphBackend,
    device: torch.device,
    pool: Any,
    lane: Any,
    turn: PoolTurn,
    scalars: ScalarSlots,
    warmups: int,
    capture_error_mode: str,
) -> Entry:
    """Capture ``module`` called with ``lifted`` (the call with its lifted scalars as
    markers) into ``pool`` on ``lane`` and return its entry; its output holds this call's
    result (the capture executed the step).

    ``warmups`` eager runs go first, on the lane with their allocations in the pool: the
    capture reuses the blocks they freed (DESIGN.md, "Warm-ups in the pool"); they wait for the
    pool's last use (``turn``), which may still run on any stream. ``call`` is the caller's
    call (the objects it refers to by identity are kept alive with the entry), ``live`` its
    tensors in containers, ``values`` its lifted numbers (placed into 0-dim buffers by
    ``scalars``); ``capture_error_mode`` is CUDA's.

    Raises:
        BaseException: whatever the warm-ups or the capture raised, after the graph was reset
            and the current stream made to wait for the lane (the static buffers may then be
            freed). The pool may hold routing left by a capture that failed half-way: the
            caller decides whether to renew it.
    """
    statics: list[torch.Tensor] = []
    fill: list[int] = []

    def make_static(t: torch.Tensor) -> torch.Tensor:
        buf = static_buffer(t, device)
        if t.dim() == 0 and t.is_cpu and not buf.is_cpu:
            fill.append(len(statics))
        statics.append(buf)
        return buf

    static_args, static_kwargs = static_call(*lifted, make_static)
    slots: list[torch.Tensor] = []
    if values:
        static_args, static_kwargs, slots = scalars.place(
            static_args, static_kwargs, values, device
        )
    # Containers of their own (those without a tensor were the caller's): a step changing one
    # is refused below, and its warm-ups must not have changed the caller's.
    static_args, static_kwargs = _trees.copy_containers((static_args, static_kwargs))
    containers = _trees.container_snapshot(static_args, static_kwargs)
    graph = BreakableCUDAGraph(pool=pool, backend=backend.name)
    # Static buffers and scalar slots are device memory the graph re-reads at every replay.
    backend.note_graph_memory(pool, [*statics, *slots])
    current = backend.current_stream(device)
    started = time.perf_counter()
    try:
        with graph.warmup(), enable_breakable_cuda_graph():
            turn.wait(lane)
            for _ in range(warmups):
                module(*static_args, **static_kwargs)
                _refuse_changed_containers(containers)
        backend.synchronize((lane,))  # start-up only: the capture's own time is reported
        versions = [t._version for t in statics]
        captured = time.perf_counter()
        with (
            enable_breakable_cuda_graph(),
            internal_capture(graph, capture_error_mode=capture_error_mode),
        ):
            output = module(*static_args, **static_kwargs)
        _refuse_changed_containers(containers)
        _refuse_hidden_output_tensors(output)
        output = _without_history(output)
        backend.synchronize((lane,))
        done = time.perf_counter()
        stubbed = graph._ran_stubs()
        if stubbed:
            # The capture's output (and what it wrote into the arguments) was computed from a
            # capture_stub's values, not this call's: one replay computes them.
            with enable_breakable_cuda_graph():
                graph.replay()
    except BaseException:
        current.wait_stream(lane)  # before the static buffers are freed
        graph.reset()
        raise
    # Arguments the captured step wrote in place (a KV cache, a position advanced): copied
    # back after every replay, as eager would have left them. (An in-place change of shape,
    # such as unsqueeze_, is not replayed by a graph: nothing to copy.)
    written = tuple(
        i for i, t in enumerate(statics) if t._version != versions[i] and t.shape == live[i].shape
    )
    # The other buffers a break receives: it may write one at a replay (see Entry.watched).
    others = {
        ptr: i
        for i, t in enumerate(statics)
        if i not in written and (ptr := t.untyped_storage().data_ptr())
    }
    watched = tuple(
        (t, others[ptr])
        for t in graph._break_argument_tensors()
        if (ptr := t.untyped_storage().data_ptr()) in others
    )
    return Entry(
        graph=graph,
        statics=statics,
        fill=tuple(fill),
        scalars=slots,
        output=output,
        static_call=(static_args, static_kwargs),
        keep_alive=identity_objects(*call),
        capture_runs=warmups + 1 + stubbed,
        capture_ms=(done - captured) * 1e3,
        pool_bytes=graph.pool_bytes(),
        warmup_ms=(captured - started) * 1e3,
        inference=torch.is_inference_mode_enabled(),
        autocast=autocast_state(),
        # Both sets are of objects alive now, so no id is another's.
        passed=frozenset(_trees.object_ids(call) & _trees.object_ids(output)),
        written=written,
        overlap=OverlapCheck(written, object_tensors(*lifted)),
        watched=watched,
        objects=call_objects(*lifted),
    )


def _refuse_changed_containers(containers: _trees.Snapshot) -> None:
    """Raise when the step changed a container it was given (``state["out"] = y``,
    ``items.append(t)``). It received copies (their tensors are static buffers), so the change
    would reach the caller neither at capture nor at replay (a replay runs no Python): the
    signature runs eagerly, where the step changes the caller's own container.

    Raises:
        CaptureError: naming the container and what changed.
    """
    changed = _trees.changed_container(containers)
    if changed is not None:
        raise CaptureError(
            f"the step changed a container argument it was given, {changed}; a graph passes "
            "the step copies of its container arguments and a replay runs no Python, so the "
            "change would never reach the caller's container: such calls run eagerly. Return "
            "the value instead of storing it in an argument (or keep it on a dataclass or "
            "object argument, passed as itself) to capture the call"
        )


def _refuse_hidden_output_tensors(output: Any) -> None:
    """Raise when the output holds tensors where a runner cannot clone them (a ``set`` of
    tensors, an unregistered ``list`` subclass): each call would return the static output
    itself, which the next replay overwrites (an earlier result changed silently).

    Raises:
        CaptureError: naming the container.
    """
    holder = _trees.hidden_tensor_holder(output)
    if holder is not None:
        raise CaptureError(
            f"the step returns tensors inside a {holder}, which the runner cannot copy out of "
            "the graph's static output (the next replay would overwrite them): such calls run "
            "eagerly. Return them in a list, tuple, dict, named tuple or dataclass (or "
            "register the type with torch.utils._pytree) to capture the call"
        )


def _without_history(output: Any) -> Any:
    """``output`` with each tensor that requires grad detached, once per tensor (one tensor
    returned twice stays one). Replays overwrite what the capture's autograd graph saved: a
    backward through it would compute from other values, so a replay's outputs carry no
    history."""
    detached: dict[int, torch.Tensor] = {}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not t.requires_grad:
            return t
        if id(t) not in detached:
            detached[id(t)] = t.detach()
        return detached[id(t)]

    return _trees.map_tensors(output, leaf)
