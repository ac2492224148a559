"""What a cache key is made of: every part named, each from the owner that knows it (after Inductor's
`FxGraphHashDetails`).

- `module`, `state`, `training`: the module (`state_fingerprint`): its class; structure, memory layout and every plain
  value the guard checks.
- `signature`, `layout`, `shapes`: the recorded call (`core/signature.py`): the input signature or shape family, the
  tensors' memory layout.
- `backends`: each candidate, with its options (`Backend.describe`).
- `versions`: the core's (python, torch, aitune-hf), and each backend's own packages (`Backend.versions`).
- `strategy`, `min_speedup`, `precision`, `quality`, `tolerances`: the config (how the choice was made).
- `device`, `threads`: the machine (`aitune_hf/hardware.py`): CPU architecture, ISA and flags, or GPU and capability.
- `over` (only for a module kept whole over its blocks, `Target.inner`): the blocks' classes, which its candidates were
  timed against.

`versions` holds the packages of every backend this process knows (`backends.base.backend_classes`), not only of
the candidates: that is what the key has always held (ONNX Runtime's versions in every key), so entries written
before keys moved here are still found.

Names that say where a model came from rather than what it computes (a framework's `_name_or_path`, the version
that wrote its config) are left out of `state_fingerprint`: the layer that knows those frameworks registers them
(`register_incidental`, filled by `aitune_hf.hf`); the core names no framework.

Storage of what a key finds is `core/cache.py`'s job; this module only says what the key holds.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from aitune_hf import hardware
from aitune_hf.backends.base import Backend, backend_classes, installed_version
from aitune_hf.core.guards import ModuleGuard
from aitune_hf.core.signature import InputSignature

if TYPE_CHECKING:
    from aitune_hf.core.config import TuningConfig

#: Attributes (and config keys) left out of `state_fingerprint`: where a model was loaded from, or how its config was
#: written, not what it computes; so that one model loaded twice, or from two paths (a fleet's replicas), has one
#: fingerprint. Filled by the layer that knows the frameworks (`register_incidental`).
_INCIDENTAL: set[str] = set()


def register_incidental(*names: str) -> None:
    """Leave attributes (and config keys) called `names` out of every state fingerprint from now on. Registered at
    import by the framework layer, before any key is made: a name registered later would change keys."""
    _INCIDENTAL.update(names)


def incidental() -> frozenset[str]:
    """The names left out of state fingerprints (`register_incidental`)."""
    return frozenset(_INCIDENTAL)


def key_of(fields: dict[str, Any]) -> str:
    """The key (an entry's folder name) of `fields`: a digest of their JSON text."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def key_fields(
    module: torch.nn.Module,
    signatures: Sequence[InputSignature],
    dynamic: bool,
    config: TuningConfig,
    candidates: Sequence[Backend],
    strategy: str,
    layout: str,
    state: str | None = None,
    over: Sequence[str] = (),
) -> dict[str, Any]:
    """Every part of a decision's key (the table of the module docstring), as JSON-ready text. `layout`: the memory
    layout of the recorded call's tensors (`signature.layout_of`); `state`: the module's `state_fingerprint` when the
    caller has it already (None: computed here); `over`: for a module kept whole over its blocks, their classes (its
    candidates were timed against them: `over` is in the key only then, so other keys are as they were)."""
    signature = signatures[0]
    kind = type(module)
    extra = {"over": list(over)} if over else {}
    return {
        **extra,
        "module": f"{kind.__module__}.{kind.__qualname__}",
        "state": state if state is not None else state_fingerprint(module),
        "signature": repr(signature.family) if dynamic else repr(signature),
        "layout": layout,
        "shapes": config.shapes if dynamic else "exact",
        "training": module.training,
        "backends": [backend.describe() for backend in candidates],
        "strategy": strategy,
        "min_speedup": config.min_speedup,
        "precision": list(config.precisions),
        "quality": config.quality,
        "tolerances": sorted((str(dtype), list(pair)) for dtype, pair in config.tolerances.items()),
        # A candidate that is not registered (an instance passed in the config) brings its own packages too.
        "versions": {**{k: v for backend in candidates for k, v in backend.versions().items()}, **versions()},
        "device": device_fingerprint(signature.devices),
        "threads": torch.get_num_threads(),
    }


def versions() -> dict[str, str | None]:
    """The versions a decision depends on: python, torch and aitune-hf (the core's), and each known backend's own
    packages (`Backend.versions`)."""
    found: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "aitune-hf": installed_version("aitune-hf"),
    }
    for backend in backend_classes():
        found.update(backend.versions())
    return found


def device_fingerprint(devices: frozenset[torch.device]) -> list[str]:
    """The devices a decision was made on: CPU architecture, ISA and kernel-relevant flags; GPU name and
    compute capability."""
    return sorted(_device_text(device) for device in devices) or [_device_text(torch.device("cpu"))]


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor}"
    if device.type == "cpu":
        return hardware.cpu_text()
    return device.type


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every parameter's and buffer's values (what a baked artifact holds): names the folder of an
    artifact that bakes weights, so that it is never loaded for other weights."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            data = tensor.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            data = data.contiguous()
            if data.numel():
                digest.update(data.view(torch.uint8).numpy().tobytes() if data.dtype != torch.bool else data.numpy())
    return digest.hexdigest()


def build_state(fingerprint: str, training: bool, signatures: Sequence[InputSignature], dynamic: bool) -> str:
    """What builds of one process may share work by (`BuildContext.state`): the module's `state_fingerprint`
    (`fingerprint`), its training flag, and the recorded calls' signatures (shapes, dtypes, devices, and the modes the
    calls ran under: autocast, grad, default dtype...) or their family. Weight values are not in it: a build puts its
    own in."""
    digest = hashlib.sha256(fingerprint.encode())
    digest.update(f"training={training} dynamic={dynamic}".encode())
    for text in sorted({repr(s.family) if dynamic else repr(s) for s in signatures}):
        digest.update(text.encode())
    return digest.hexdigest()


def state_fingerprint(module: torch.nn.Module) -> str:
    """A digest of what a `ModuleGuard` guards, in a form that is the same in every process: the text of its guard
    list (`ModuleGuard.text`): the structure (each submodule's path and class; each parameter's and buffer's name,
    shape, dtype and memory layout), every plain value in the submodules' state and in objects below them, and the
    types of the objects the guard holds by identity (an attention processor's class). Weight values are not in it
    (see `weights_digest`), nor incidental names (`register_incidental`). The persistent cache keys decisions by it."""
    digest = hashlib.sha256()
    for line in ModuleGuard(module).text(incidental()):
        digest.update(line.encode())
    return digest.hexdigest()
