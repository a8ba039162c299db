"""One tree walker for every user structure: bridges, break arguments, runner arguments and
outputs. The scenarios that capture run on the shared ``device`` fixture (CPU graph backend
everywhere, CUDA graphs where a GPU is present)."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from graph_helpers import capture as _capture

from bcg_core import (
    BreakableGraphRunner,
    BreakOutputError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    signature_of,
)
from bcg_core._trees import (  # noqa: PLC2701
    difference,
    flatten,
    key_paths,
    map_tensors,
    same_up_to_key_order,
    tensor_leaves,
)


class AttnOut(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor


@dataclasses.dataclass
class Step:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor


class Meta:
    def __init__(self, seq_lens: torch.Tensor) -> None:
        self.seq_lens = seq_lens
        self.max_len = 7


# -- the walker itself --------------------------------------------------------------------------


def test_flatten_walks_every_kind_and_names_each_leaf() -> None:
    t = torch.ones(2)
    obj = (t, [AttnOut(t, t)], {"b": t, "a": Step(t, t)}, Meta(t), Frozen(t), 5)
    leaves, spec = flatten(obj)
    assert sum(isinstance(x, torch.Tensor) for x in leaves) == 8
    assert key_paths(spec, "x") == [
        "x[0]",
        "x[1][0].out",
        "x[1][0].lse",
        "x[2]['b']",
        "x[2]['a'].logits",
        "x[2]['a'].hidden",
        "x[2]['a'].note",
        "x[3].seq_lens",
        "x[3].max_len",
        "x[4].a",
        "x[5]",
    ]


def test_map_keeps_types_and_shares_untouched_nodes() -> None:
    t = torch.ones(2)
    meta = Meta(t)
    obj = {"o": AttnOut(t, t), "s": Step(t, t), "f": Frozen(t), "m": meta, "d": OrderedDict(k=t)}
    doubled = map_tensors(obj, lambda x: x * 2)
    assert isinstance(doubled["o"], AttnOut) and torch.equal(doubled["o"].lse, t * 2)
    assert isinstance(doubled["s"], Step) and doubled["s"].note == "x"
    assert isinstance(doubled["f"], Frozen) and torch.equal(doubled["f"].a, t * 2)
    assert type(doubled["d"]) is OrderedDict
    assert doubled["m"] is not meta and meta.seq_lens is t  # a copy; the original untouched
    assert map_tensors(obj, lambda x: x * 2, into_objects=False)["m"] is meta
    assert map_tensors(obj, lambda x: x) is obj


def test_tensor_leaves_can_stop_at_objects() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    obj = ([a, AttnOut(b, b)], {"m": Meta(c), "s": Step(d, d)})
    assert [t.item() for t in tensor_leaves(obj)] == [0.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    # containers and pytree nodes (the named tuple) are walked, the objects are not
    assert [t.item() for t in tensor_leaves(obj, into_objects=False)] == [0.0, 1.0, 1.0]


def test_cycles_are_leaves() -> None:
    meta = Meta(torch.ones(1))
    meta.me = meta  # type: ignore[attr-defined]
    leaves, spec = flatten(meta)
    assert leaves[-1] is meta
    assert key_paths(spec)[-1] == ".me"


def test_structure_differences_are_named() -> None:
    t = torch.ones(1)
    assert (
        difference(flatten((t,))[1], flatten(t)[1]) == "output is a tuple of length 1, was a tensor"
    )
    assert "dict with keys" in str(difference(flatten({"a": t})[1], flatten([t])[1]))
    assert difference(flatten({"a": (t, None)})[1], flatten({"a": (t, t)})[1]) == (
        "output['a'][1] is a non-tensor value, was a tensor"
    )
    assert same_up_to_key_order(flatten({"a": t, "b": t})[1], flatten({"b": t, "a": t})[1])
    assert not same_up_to_key_order(flatten({"a": t})[1], flatten({"b": t})[1])


# -- bridges: structure at replay ------------------------------------------------------------------


def _break_returning(outputs: list[Any]) -> Any:
    """A break that returns ``outputs[0]`` at capture and the next item at each later call."""
    calls = iter(outputs)

    @eager_on_graph
    def step(x: torch.Tensor) -> Any:
        return next(calls)

    return step


@pytest.mark.parametrize(
    ("at_capture", "at_replay", "message"),
    [
        (lambda h: h, lambda h: (h,), "output is a tuple of length 1, was a tensor"),
        (lambda h: (h,), lambda h: h, "output is a tensor, was a tuple of length 1"),
        (lambda h: {"h": h}, lambda h: [h], "output is a list of length 1, was a dict"),
        (lambda h: {"h": h}, lambda h: {"g": h}, "output is a dict with keys ['g']"),
        (lambda h: AttnOut(h, h), lambda h: (h, h), "output is a tuple of length 2, was a AttnOut"),
        # flat tuples and lists, such as transformers' (out, None), take a faster path
        (lambda h: (h, None), lambda h: (None, h), "output[0] is a non-tensor value, was a tensor"),
        (lambda h: (h, None), lambda h: [h, None], "output is a list of length 2, was a tuple"),
        (lambda h: (h, None), lambda h: (h, (h,)), "output[1] is a tuple of length 1, was a non"),
        (lambda h: (h, None), lambda h: (h, None, 1), "output is a tuple of length 3, was a tuple"),
    ],
)
def test_break_structure_change_raises(
    device: str, at_capture: Any, at_replay: Any, message: str
) -> None:
    x = torch.ones(4)
    step = _break_returning([at_capture(torch.zeros(4)), at_replay(torch.ones(4))])
    graph, _ = _capture(lambda: step(x))
    with pytest.raises(BreakOutputError, match="returned") as info:
        graph.replay()
    assert message in str(info.value)
    assert repr(step.__qualname__) in str(info.value)


def test_break_flat_tuple_refreshes_tensors_and_checks_plain_values(device: str) -> None:
    x = torch.zeros(3)
    state = {"n": 0}

    @eager_on_graph
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, None, int, torch.Tensor]:
        return x + 1, None, state["n"], x * 2

    def step() -> torch.Tensor:
        a, _, n, b = pair(x)
        return a * 10 + b + n

    graph, result = _capture(step)  # n is 0 at capture: the graph adds 0
    for value in (1.0, 5.0, -2.0):
        x.fill_(value)
        graph.replay()
        assert torch.equal(result, (x + 1) * 10 + x * 2), (result, x)
    state["n"] = 3  # eager would add 3: the replay must not return the capture's result
    with pytest.raises(BreakOutputError, match=r"output\[2\] is 3 at replay but was 0"):
        graph.replay()
    state["n"] = 0  # the graph is still good for the value it was captured with
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(result, (x + 1) * 10 + x * 2)


@pytest.mark.parametrize(
    ("at_capture", "at_replay", "raises"),
    [
        (None, None, False),
        (float("nan"), float("nan"), False),
        ("mha", "mha", False),
        (1, True, True),  # another type
        (None, 0, True),
        (0.5, 0.25, True),
        ("mha", "gqa", True),
    ],
)
def test_break_plain_values_in_a_dict_must_come_back_equal(
    device: str, at_capture: Any, at_replay: Any, raises: bool
) -> None:
    x = torch.zeros(2)
    values = iter([at_capture, at_replay])

    @eager_on_graph
    def split(x: torch.Tensor) -> dict[str, Any]:
        return {"v": next(values), "out": x + 1}

    graph, result = _capture(lambda: split(x)["out"] * 2)
    x.fill_(4.0)
    if raises:
        with pytest.raises(BreakOutputError, match=r"output\['v'\]"):
            graph.replay()
    else:
        graph.replay()
        assert torch.equal(result, torch.full((2,), 10.0))


def test_break_values_inside_objects_are_not_judged(device: str) -> None:
    x = torch.zeros(2)
    calls = iter(range(100))

    @eager_on_graph
    def with_meta(x: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        meta = Meta(x + 1)
        meta.max_len = next(calls)  # host state of an object: its own business
        return x * 3, meta

    graph, result = _capture(lambda: with_meta(x)[0] + with_meta(x)[1].seq_lens)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(result, torch.full((2,), 9.0))


def test_break_dict_in_another_key_order_is_matched_by_key(device: str) -> None:
    x = torch.zeros(3)
    state = {"flip": False}

    @eager_on_graph
    def split(x: torch.Tensor) -> dict[str, torch.Tensor]:
        a, b = x + 1, x + 2
        return {"b": b, "a": a} if state["flip"] else {"a": a, "b": b}

    def step() -> torch.Tensor:
        out = split(x)
        return out["a"] * 10 + out["b"]

    graph, result = _capture(step)
    state["flip"] = True
    for value in (1.0, 5.0, -2.0):
        x.fill_(value)
        graph.replay()
        expected = (x + 1) * 10 + (x + 2)
        assert torch.equal(result, expected), (result, expected)


def test_break_namedtuple_and_dataclass_outputs_refresh(device: str) -> None:
    x = torch.zeros(2)

    @eager_on_graph
    def attention(x: torch.Tensor) -> AttnOut:
        return AttnOut(x * 2, x + 1)

    @eager_on_graph
    def head(x: torch.Tensor) -> Step:
        return Step(x * 3, x - 1, note="fresh")

    def step() -> torch.Tensor:
        o = attention(x)
        assert isinstance(o, AttnOut)
        s = head(o.out)
        return o.lse + s.logits + s.hidden

    graph, result = _capture(step)
    for value in (1.0, 4.0):
        x.fill_(value)
        graph.replay()
        assert torch.equal(result, (x + 1) + x * 6 + (x * 2 - 1))


# -- the runner: outputs cloned with their type, objects never stale ----------------------------


def test_runner_clones_dataclass_and_namedtuple_outputs(device: str) -> None:
    def model(x: torch.Tensor) -> tuple[Step, AttnOut]:
        return Step(x * 2, x + 1), AttnOut(x - 1, x * x)

    runner = BreakableGraphRunner(model, device=device)
    runner.capture(torch.ones(3))
    first = runner(torch.full((3,), 2.0))
    second = runner(torch.full((3,), 5.0))
    assert isinstance(first[0], Step) and isinstance(first[1], AttnOut)
    assert torch.equal(first[0].logits, torch.full((3,), 4.0))  # not overwritten by the 2nd call
    assert torch.equal(first[1].lse, torch.full((3,), 4.0))
    assert torch.equal(second[0].hidden, torch.full((3,), 6.0))
    assert runner.stats.hits == 2


def test_runner_tensor_rebound_on_object_is_a_miss_not_stale(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    def model(x: torch.Tensor, meta: Meta) -> torch.Tensor:
        return x + meta.seq_lens

    meta = Meta(torch.full((3,), 2.0))
    runner = BreakableGraphRunner(model, device=device)
    x = torch.zeros(3)
    runner.capture(x, meta)
    meta.seq_lens.copy_(torch.full((3,), 4.0))  # in place: same address, a hit
    assert torch.equal(runner(x, meta), torch.full((3,), 4.0))
    assert runner.stats.hits == 1
    meta.seq_lens = torch.full((3,), 10.0)  # rebound: the graph would read the old tensor
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        out = runner(x, meta)
    assert torch.equal(out, torch.full((3,), 10.0))
    assert runner.stats.misses == 1
    assert "args[1].seq_lens" in caplog.text and "copy new values into it" in caplog.text


def test_signature_keys_objects_by_contents() -> None:
    t = torch.ones(2)
    assert signature_of((Meta(t),), {}) == signature_of((Meta(t),), {})
    assert signature_of((Meta(t),), {}) != signature_of((Meta(torch.ones(2)),), {})
    assert signature_of(({"a": t, "b": 1},), {}) != signature_of(({"a": t, "b": 2},), {})


def test_breakable_attention_keeps_namedtuple_type(device: str) -> None:
    from bcg_diffusion import install_breakable_attention

    class LSEAttention(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> AttnOut:
            return AttnOut(q * 2, q + 1)

    attention = LSEAttention()
    q = torch.zeros(2)
    with install_breakable_attention(LSEAttention):
        with enable_breakable_cuda_graph():
            eager = attention(q)
        assert isinstance(eager, AttnOut)
        graph, out = _capture(lambda: attention(q))
        assert isinstance(out, AttnOut) and graph.num_breaks == 1
        q.fill_(3.0)
        graph.replay()
        assert torch.equal(out.lse, torch.full((2,), 4.0))


def test_the_flat_fast_path_gives_the_walks_signature() -> None:
    # A call of plain tensors, plain values and lifted scalars (positional or keyword) skips
    # the walk; its signature must be the walk's, or a replay would miss (or worse, share).
    from bcg_core._signature import (  # noqa: PLC2701
        ScalarInput,
        signature_and_tensors,
        walked_signature,
    )

    a, b = torch.zeros(2, 3), torch.ones(4, dtype=torch.float16)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((a, b), {}),
        ((), {"hidden": a, "temb": b}),
        ((a,), {"t": ScalarInput(float), "guidance": b, "mode": "x", "n": 3, "dt": torch.int8}),
        ((a, None, 2.5, True), {"z": b, "a": a}),
        ((), {}),
    ]
    for args, kwargs in calls:
        fast, fast_live = signature_and_tensors(args, kwargs)
        slow, slow_live = walked_signature(args, kwargs)
        assert fast == slow and hash(fast) == hash(slow), (args, kwargs)
        assert [t is u for t, u in zip(fast_live, slow_live, strict=True)] == [True] * len(
            slow_live
        )
    # Different keyword names, kinds or shapes are different signatures.
    assert signature_and_tensors((), {"x": a})[0] != signature_and_tensors((), {"y": a})[0]
    assert signature_and_tensors((), {"x": a})[0] != signature_and_tensors((), {"x": 1})[0]
    assert signature_and_tensors((a,), {})[0] != signature_and_tensors((), {"x": a})[0]
    assert signature_and_tensors((a,), {})[0] != signature_and_tensors((b,), {})[0]


def test_the_guard_of_a_flat_call_passes_exactly_the_calls_of_its_signature() -> None:
    # A runner replays its last hit when FlatGuard.match passes: a pass where the signature
    # differs would replay the wrong graph. Random flat calls, every pair compared both ways.
    import random

    from bcg_core._signature import FlatGuard, ScalarInput, signature_and_tensors  # noqa: PLC2701

    marker = ScalarInput(float)
    leaves: list[Any] = [
        torch.zeros(2, 3), torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3, device="meta"), torch.ones(2, 3), torch.zeros(()),
        1, 2, True, 1.0, -0.0, 0.0, "a", None, torch.int8, torch.device("cpu"), marker,
    ]  # fmt: skip
    rng = random.Random(0)

    def a_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = tuple(rng.choice(leaves) for _ in range(rng.randint(0, 2)))
        names = rng.sample(["t", "h", "z"], rng.randint(0, 2))
        return args, {n: rng.choice(leaves) for n in names}

    calls = [a_call() for _ in range(300)]
    passes = 0
    for first in calls:
        guard = FlatGuard.of(*first)
        assert guard is not None
        sig = signature_and_tensors(*first)[0]
        for other in calls:
            other_sig, other_live = signature_and_tensors(*other)
            live = guard.match(*other)
            if live is not None:
                passes += 1
                assert other_sig == sig, (first, other)
                assert len(live) == len(other_live)
                assert all(t is u for t, u in zip(live, other_live, strict=True))
            else:
                assert other_sig != sig, (first, other)
    assert passes > 300  # every call matches itself, and some others do
    # Not flat: containers and objects are left to the walk.
    assert FlatGuard.of(([torch.zeros(1)],), {}) is None
    assert FlatGuard.of((object(),), {}) is None
