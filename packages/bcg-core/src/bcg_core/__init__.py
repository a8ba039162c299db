"""bcg-core: breakable CUDA graphs for PyTorch.

Capture a forward as CUDA graph segments separated by eager break points::

    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static_out = model(static_in)      # functions marked @eager_on_graph become breaks
    static_in.copy_(new_input)
    graph.replay()                         # static_out now holds the new result

See DESIGN.md for the invariants (pool ownership, what a break may return, side streams).
"""

from bcg_core._capture.breaks import break_graph, eager_on_graph
from bcg_core._capture.capture import BreakableCUDAGraphCapture
from bcg_core._capture.context import get_current_stream, is_breakable_capture_active
from bcg_core._capture.debug import keep_alive_ok
from bcg_core._capture.flag import (
    breakable_graphs_disabled,
    disable_breakable_graphs,
    enable_breakable_cuda_graph,
    is_in_breakable_cuda_graph,
)
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._diagnostics.check import CaptureCheck, check_capture
from bcg_core._diagnostics.divergence import check_divergence
from bcg_core._diagnostics.divergence_report import DivergenceReport, TensorDiff
from bcg_core._errors import (
    BCG_FAILURE_HINT,
    BreakableGraphError,
    BreakOutputError,
    CaptureError,
    ConcurrentCaptureError,
    ReplayError,
    UnjoinedStreamError,
)
from bcg_core._integrations.continuous_batching import (
    ContinuousBatchingHandle,
    ContinuousBatchingStats,
    enable_continuous_batching,
)
from bcg_core._integrations.transformers import breakable_attention
from bcg_core._patching import PatchHandle, patch_attribute
from bcg_core._runner.runner import BreakableGraphRunner
from bcg_core._runner.stats import CaptureReport, EntryStats, GraphMemory, RunnerStats
from bcg_core._signature import describe_difference, signature_of
from bcg_core._version import __version__

__all__ = [
    "BCG_FAILURE_HINT",
    "BreakOutputError",
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "BreakableGraphError",
    "BreakableGraphRunner",
    "CaptureCheck",
    "CaptureError",
    "CaptureReport",
    "ConcurrentCaptureError",
    "ContinuousBatchingHandle",
    "ContinuousBatchingStats",
    "DivergenceReport",
    "EntryStats",
    "GraphMemory",
    "PatchHandle",
    "ReplayError",
    "RunnerStats",
    "TensorDiff",
    "UnjoinedStreamError",
    "__version__",
    "break_graph",
    "breakable_attention",
    "breakable_graphs_disabled",
    "check_capture",
    "check_divergence",
    "describe_difference",
    "disable_breakable_graphs",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "enable_continuous_batching",
    "get_current_stream",
    "is_breakable_capture_active",
    "is_in_breakable_cuda_graph",
    "keep_alive_ok",
    "patch_attribute",
    "signature_of",
]
