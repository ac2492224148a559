"""The onnxruntime backend on its own: input marshalling, live and baked weights, the `weights=` option."""

from __future__ import annotations

import collections
import copy
import uuid
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from aitune_hf.backends import OnnxRuntimeBackend
from aitune_hf.backends.base import BuiltBackend, build_context
from aitune_hf.errors import ConfigError

TOL = {"atol": 1e-5, "rtol": 1e-5}


class Scale(nn.Module):
    """(x * weight * gain + bias) * t, and t * gain, whose shape is t's: a 0-d `t` must stay 0-d."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.register_buffer("bias", torch.randn(width))
        self.register_buffer("gain", torch.tensor(1.5), persistent=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * self.weight * self.gain + self.bias) * t, t * self.gain


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Tied(nn.Module):
    """The same Parameter under two names (as tied embeddings are)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(width, width, bias=False)
        self.second = nn.Linear(width, width, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def build(module: nn.Module, *args: Any, backend: OnnxRuntimeBackend | None = None, **kwargs: Any) -> BuiltBackend:
    backend = backend or OnnxRuntimeBackend(intra_op_num_threads=1)
    with torch.no_grad():
        return backend.build(module, module.forward, [(args, kwargs)])


def check(built: BuiltBackend, module: nn.Module, *args: Any, **kwargs: Any) -> None:
    with torch.no_grad():
        expected = module(*args, **kwargs)
        got = built.fn(*args, **kwargs)
    torch.testing.assert_close(got, expected, **TOL)  # shapes, dtypes and structure included


CASES = {
    "0-d": lambda: (torch.randn(2, 3), torch.tensor(0.7)),
    "empty": lambda: (torch.randn(0, 3), torch.tensor(2.0)),
    "non-contiguous": lambda: (torch.randn(3, 4).t(), torch.tensor(2.0)),
    "broadcast": lambda: (torch.randn(3).expand(4, 3), torch.tensor(2.0)),
    "sliced": lambda: (torch.randn(4, 6)[:, ::2], torch.tensor(2.0)),
}


@pytest.mark.parametrize("weights", ["live", "baked"])
@pytest.mark.parametrize("case", list(CASES))
def test_marshalling(case: str, weights: str) -> None:
    module = Scale().eval()
    x, t = CASES[case]()
    built = build(module, x, t=t, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights))
    check(built, module, x, t=t)
    x2, t2 = CASES[case]()  # fresh values, same layout
    check(built, module, x2, t=t2)


Pair = collections.namedtuple("Pair", "first second")


class Nested(nn.Module):
    """A call whose tensors sit in every container a block's call may use: positional, keyword, a dict with a None, a
    namedtuple and a list, beside plain values (the runner finds the session's inputs in pytree's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, *, extra: dict[str, Any], pair: Pair, flag: bool = True
    ) -> dict[str, torch.Tensor]:
        y = self.linear(x) * extra["scale"] + pair.first - pair.second[1]
        if mask is not None:
            y = y * mask
        return {"y": y if flag else -y, "z": extra["items"][0] * 2}


@pytest.mark.parametrize("weights", ["live", "baked"])
def test_nested_inputs_are_fed_in_pytree_order(weights: str) -> None:
    module = Nested().eval()

    def call() -> tuple[tuple[Any, ...], dict[str, Any]]:
        extra = {"skip": None, "scale": torch.randn(4), "items": [torch.randn(2, 4)]}
        pair = Pair(torch.randn(4), [torch.randn(4), torch.randn(4)])
        return (torch.randn(3, 4), None), {"extra": extra, "pair": pair, "flag": False}

    args, kwargs = call()
    built = build(module, *args, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights), **kwargs)
    check(built, module, *args, **kwargs)
    args, kwargs = call()  # fresh values, same structure
    check(built, module, *args, **kwargs)


@pytest.mark.parametrize("weights", ["live", "baked"])
def test_channels_last(weights: str) -> None:
    module = ConvNet().eval()
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    built = build(module, x, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights))
    check(built, module, x)


@pytest.mark.parametrize("weights", ["live", "baked"])
def test_weights_that_require_grad_or_are_inference_tensors(weights: str) -> None:
    backend = OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights)
    module = MLP().eval()
    assert all(p.requires_grad for p in module.parameters())
    x = torch.randn(2, 8)
    check(build(module, x, backend=backend), module, x)
    with torch.inference_mode():
        frozen = MLP().eval()
        x = torch.randn(2, 8)
    assert all(p.is_inference() for p in frozen.parameters())
    check(build(frozen, x, backend=backend), frozen, x)


def test_live_weights_follow_every_edit() -> None:
    module = MLP().eval()
    x = torch.randn(3, 8)
    built = build(module, x, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights="live"))
    assert built.bakes_weights is False
    check(built, module, x)
    with torch.no_grad():
        module.up.weight.data.add_(1.0)  # bumps no version counter
    check(built, module, x)
    module.down.weight.data = torch.randn_like(module.down.weight)  # a re-assigned .data
    check(built, module, x)
    module.load_state_dict(MLP().state_dict())
    check(built, module, x)
    module.up.bias = nn.Parameter(torch.randn_like(module.up.bias))  # a replaced Parameter
    check(built, module, x)


def test_live_buffers_follow_edits() -> None:
    module = Scale().eval()
    x, t = torch.randn(2, 3), torch.tensor(0.5)
    built = build(module, x, t=t, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights="live"))
    module.bias.add_(1.0)
    module.gain.fill_(-2.0)  # a non-persistent buffer
    check(built, module, x, t=t)
    module.bias = torch.randn(3)  # a replaced buffer
    check(built, module, x, t=t)


def test_live_replaced_submodule_raises() -> None:
    module = MLP().eval()
    x = torch.randn(3, 8)
    built = build(module, x, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights="live"))
    module.up = nn.Linear(8, 16)
    with pytest.raises(RuntimeError, match="replaced"):
        built.fn(x)


def test_baked_reports_baked_weights() -> None:
    module = MLP().eval()
    x = torch.randn(3, 8)
    backend = OnnxRuntimeBackend(intra_op_num_threads=1, weights="baked")
    assert backend.bakes_weights is True and backend.describe() == "onnxruntime"
    built = build(module, x, backend=backend)
    assert built.bakes_weights is True
    check(built, module, x)


def test_baked_is_the_default_and_live_bakes_nothing() -> None:
    backend = OnnxRuntimeBackend(intra_op_num_threads=1)
    assert backend.weights == "baked" and backend.bakes_weights is True and backend.describe() == "onnxruntime"
    live = OnnxRuntimeBackend(intra_op_num_threads=1, weights="live")
    assert live.bakes_weights is False and live.describe() == "onnxruntime(weights=live)"
    mlp, x = MLP().eval(), torch.randn(2, 8)
    assert build(mlp, x, backend=backend).bakes_weights is True
    built = build(mlp, x, backend=live)
    assert built.bakes_weights is False
    with torch.no_grad():
        mlp.up.weight.data.mul_(2.0)
    check(built, mlp, x)


@pytest.mark.parametrize("weights", ["live", "baked"])
def test_tied_weights(weights: str) -> None:
    module = Tied().eval()
    x = torch.randn(2, 6)
    built = build(module, x, backend=OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights))
    check(built, module, x)
    if weights == "live":
        with torch.no_grad():
            module.first.weight.data.mul_(0.5)  # both names see it
        check(built, module, x)
        module.second.weight = nn.Parameter(torch.randn(6, 6))  # untied after building
        check(built, module, x)


def test_invalid_weights_option() -> None:
    with pytest.raises(ConfigError, match=r"weights='frozen'.*'baked', 'live'"):
        OnnxRuntimeBackend(weights="frozen")


@pytest.mark.parametrize("weights", ["live", "baked"])
def test_building_never_touches_the_module_other_threads_are_calling(weights: str) -> None:
    """The exporter swaps a module's parameters for fake tensors while it traces: the backend exports a copy,
    so a server thread calling the same module meanwhile keeps getting real, correct outputs."""
    import threading

    module = MLP(width=32).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = module(x)
    done, seen, errors = threading.Event(), [], []

    def serve() -> None:
        while not done.is_set():
            try:
                with torch.no_grad():
                    out = module(x)
                seen.append(type(out) is torch.Tensor and torch.equal(out, expected))
            except Exception as error:
                errors.append(error)

    server = threading.Thread(target=serve)
    server.start()
    try:
        built = OnnxRuntimeBackend(intra_op_num_threads=1, weights=weights).build(module, module.forward, [((x,), {})])
    finally:
        done.set()
        server.join()
    assert not errors and seen and all(seen), (errors[:1], seen.count(False))
    check(built, module, x)


class Folded(nn.Module):
    """Uses `weight * 2` as a whole tensor: the exporter folds it into an initializer that no weight equals."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * 2)


def _builds(backend: OnnxRuntimeBackend, modules: list[nn.Module], x: torch.Tensor) -> list[BuiltBackend]:
    """The first module's build, then the others' as the core builds an identical sibling's decision."""
    with torch.no_grad():
        first = backend.build(modules[0], modules[0].forward, [((x,), {})], dynamic=True)
        with build_context(sibling=True):
            return [first, *(backend.build(m, m.forward, [((x,), {})], dynamic=True) for m in modules[1:])]


def test_identical_siblings_share_one_export_with_their_own_weights() -> None:
    backend, x = OnnxRuntimeBackend(), torch.randn(3, 8)
    siblings = [MLP().eval() for _ in range(3)]
    builds = _builds(backend, siblings, x)
    assert [b.fn.source for b in builds] == ["export", "reused", "reused"]
    assert [b.reused for b in builds] == [False, True, True]
    with torch.no_grad():  # outside a sibling's decision (a module re-tuned after its state changed): exported
        assert backend.build(siblings[1], siblings[1].forward, [((x,), {})], dynamic=True).fn.source == "export"
    with torch.no_grad():
        for module, built in zip(siblings, builds, strict=True):
            torch.testing.assert_close(built.fn(x), module(x), **TOL)  # each with its own weights
        wider = torch.randn(5, 8)
        torch.testing.assert_close(builds[2].fn(wider), siblings[2](wider), **TOL)  # the family's dims stay free


def test_a_module_in_the_state_of_one_exported_before_reuses_that_export_with_its_own_weights() -> None:
    """`BuildContext.state` (the core's digest of a module's guarded state and calls): a module whose digest equals
    an earlier build's in this process, from any backend instance (a second pipeline), gets that export with its own
    weights; another digest, or a forward that is not the module's own method (a closure may trace to another
    graph), exports."""
    x, digest, other = torch.randn(3, 8), uuid.uuid4().hex, uuid.uuid4().hex
    first, second, third = (MLP().eval() for _ in range(3))
    with torch.no_grad():
        with build_context(state=lambda: digest):
            a = OnnxRuntimeBackend().build(first, first.forward, [((x,), {})])
            b = OnnxRuntimeBackend().build(second, second.forward, [((x,), {})])
            c = OnnxRuntimeBackend().build(third, lambda t: third(t), [((x,), {})])
        with build_context(state=lambda: other):
            d = OnnxRuntimeBackend().build(third, third.forward, [((x,), {})])
        assert [built.fn.source for built in (a, b, c, d)] == ["export", "reused", "export", "export"]
        assert b.reused and not (a.reused or c.reused or d.reused)
        for module, built in ((first, a), (second, b), (third, c), (third, d)):
            torch.testing.assert_close(built.fn(x), module(x), **TOL)  # each with its own weights


def test_a_sibling_whose_graph_folds_a_constant_from_its_weights_gets_its_own_values() -> None:
    """The export is kept before onnxscript's optimizer folds `weight * 2` into a constant (`Skeleton`): a sibling's
    build puts its own weights in, then optimizes."""
    backend, x = OnnxRuntimeBackend(), torch.randn(3, 8)
    siblings = [Folded().eval() for _ in range(2)]
    builds = _builds(backend, siblings, x)
    assert [b.fn.source for b in builds] == ["export", "reused"]
    with torch.no_grad():
        for module, built in zip(siblings, builds, strict=True):
            torch.testing.assert_close(built.fn(x), module(x), **TOL)


def _export(module: nn.Module, x: torch.Tensor, raw: list[Any] | None = None) -> Any:
    """`export_flat` of `module(x)` with baked weights, as a build exports it (on a private copy)."""
    from aitune_hf.backends.onnx import export as onnx_export

    twin = copy.deepcopy(module)
    leaves, spec = pytree.tree_flatten(((x,), {}))
    names = ([], ["input_0"], ["output_0"])
    with torch.no_grad():
        return onnx_export.export_flat(twin, twin.forward, {}, leaves, spec, [0], False, None, names, None, raw)


@pytest.mark.parametrize("kind", [MLP, Folded])
def test_a_skeleton_filled_with_a_modules_weights_is_byte_for_byte_that_modules_export(kind: type[nn.Module]) -> None:
    from aitune_hf.backends.onnx.reuse import Skeleton

    x, first, second = torch.randn(3, 8), kind().eval(), kind().eval()
    raw: list[Any] = []
    _export(first, x, raw)
    filled = Skeleton.of(raw[0], first, (["input_0"], ["output_0"])).fill(second)
    assert filled.SerializeToString() == _export(second, x).model_proto.SerializeToString()


def test_the_exporter_table_is_built_once_and_exports_what_torch_onnx_export_does() -> None:
    """`export_flat` hands the exporter one ATen -> ONNX table per process (torch.onnx.export builds it on every call,
    about 2 s); on the pinned torch the private pieces it needs are where it expects them (otherwise it falls back to
    torch.onnx.export, slower), and the model it exports is byte for byte the public call's."""
    from torch.onnx._internal.exporter import _core

    from aitune_hf.backends.onnx import export as onnx_export

    registry = onnx_export.torchlib_registry(None)
    assert registry is not None, "torch's exporter moved: export_flat falls back to torch.onnx.export"
    assert onnx_export.torchlib_registry(None) is registry
    assert onnx_export.torchlib_registry(onnx_export.default_opset()) is registry

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.norm(self.proj(x))) + x

    block, x = Block().eval(), torch.randn(2, 3, 8)
    dims = ({0: torch.export.Dim.AUTO},)
    public = torch.onnx.export(block, (x,), dynamic_shapes=dims, dynamo=True, optimize=True, verbose=False)
    cached = _core.export(block, (x,), None, registry=registry, dynamic_shapes=dims, optimize=True, verbose=False,
                          opset_version=onnx_export.default_opset())  # fmt: skip
    assert cached.model_proto.SerializeToString() == public.model_proto.SerializeToString()
