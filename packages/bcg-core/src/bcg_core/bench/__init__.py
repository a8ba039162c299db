"""bcg_core.bench: the harness behind ``bcg bench``, public so that workload plugins can use it.

A workload is a function ``(BenchContext) -> list[Measurement]`` registered under the
``bcg.workloads`` entry-point group (bcg-diffusion's ``dit`` is one). The harness times every
contender of a case interleaved, repeat by repeat, and takes ratios to eager and to one full
CUDA graph per repeat; ``full_graph_contender`` and ``compile_contender`` build the two
reference contenders every workload compares against, ``compiled_graph_contender`` and
``bcg_compile_contender`` the compiled-kernel ones (one plain graph of the compiled step, and a
runner over it). The toy Llama-style decoder and the
report helpers (``environment()`` for result files) are here too. See DESIGN.md, "The CLI and
the bench harness".
"""

from bcg_core.bench._cli import main
from bcg_core.bench._harness import EAGER, FULL_GRAPH, BenchContext, Contender, Measurement, Stats
from bcg_core.bench._report import environment
from bcg_core.bench._toy_decoder import DecoderConfig, ToyDecoder, bench_config, tiny_config
from bcg_core.bench._workloads import (
    WORKLOAD_GROUP,
    bcg_compile_contender,
    compile_contender,
    compiled_graph_contender,
    full_graph_contender,
    replay_check,
    runner_contender,
)

__all__ = [
    "EAGER",
    "FULL_GRAPH",
    "WORKLOAD_GROUP",
    "BenchContext",
    "Contender",
    "DecoderConfig",
    "Measurement",
    "Stats",
    "ToyDecoder",
    "bcg_compile_contender",
    "bench_config",
    "compile_contender",
    "compiled_graph_contender",
    "environment",
    "full_graph_contender",
    "main",
    "replay_check",
    "runner_contender",
    "tiny_config",
]
