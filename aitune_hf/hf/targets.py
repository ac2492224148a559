"""Target discovery: "blocks" / "components" / dotted names / a callable -> {dotted name: module}.

Names are dotted paths from the pipeline (``"unet.down_blocks.0"``, ``"transformer.single_transformer_blocks.3"``)
or, for a bare model, from the model (``"encoder.layer.0"``). Discovery reads the models' own declarations
(``_repeated_blocks``, ``_no_split_modules``) and the UNet / VAE stage layout; it hard-codes no attribute chain.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aitune_hf.errors import InputTypeError, UserInputError

TargetSelection = str | Sequence[str] | Callable[[Any], Any]
MODES = ("blocks", "components", "auto")
#: The name of a bare model registered whole (targets="components" on a model, not a pipeline).
BARE_MODEL_NAME = "model"


@dataclass(frozen=True)
class FoundTarget:
    """One target: its name, the component (root module) it lives in, its path there, and the module."""

    name: str
    component: nn.Module
    path: str
    module: nn.Module


def components_of(obj: Any) -> dict[str, nn.Module]:
    """Name -> module of each neural component: a Diffusers pipeline's components, a Transformers pipeline's
    model (named "model"), a bare model (named ""), or, for any other `nn.Module` that holds Hugging Face models
    (a sentence-transformers `SentenceTransformer`, a user's wrapper), the outermost models inside it, named by
    their path ("0.auto_model")."""
    if isinstance(obj, nn.Module):
        if is_hf_model(obj):
            return {"": obj}
        return hf_models_inside(obj) or {"": obj}
    components = getattr(obj, "components", None)
    if isinstance(components, Mapping):  # a Diffusers pipeline
        return {name: c for name, c in components.items() if isinstance(c, nn.Module)}
    model = getattr(obj, "model", None)
    if isinstance(model, nn.Module):  # a Transformers pipeline
        return {"model": model}
    raise InputTypeError(
        f"cannot find components in a {type(obj).__name__}: pass a Diffusers pipeline, a Transformers pipeline "
        f"or model, or an nn.Module"
    )


def is_hf_model(module: nn.Module) -> bool:
    """True for a Transformers `PreTrainedModel` or a Diffusers `ModelMixin` (by class hierarchy: neither library
    is imported here)."""
    return any(
        cls.__name__ in ("PreTrainedModel", "ModelMixin")
        and cls.__module__.split(".")[0] in ("transformers", "diffusers")
        for cls in type(module).__mro__
    )


def hf_models_inside(wrapper: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of the outermost Hugging Face models inside `wrapper`, in module order."""
    found: dict[str, nn.Module] = {}
    for path, module in wrapper.named_modules():
        if path and is_hf_model(module) and not any(path.startswith(f"{outer}.") for outer in found):
            found[path] = module
    return found


def _join(prefix: str, path: str) -> str:
    return ".".join(part for part in (prefix, path) if part)


def block_paths(component: nn.Module) -> list[str]:
    """Paths of the coarsest repeated units of one component, never two nested ones.

    The first rule that finds something wins: UNet-like stages, the VAE's encoder and decoder stages, the classes
    the component declares (`_repeated_blocks`, else `_no_split_modules`), then the structural fallback.
    """
    for rule in (_unet_stages, _vae_stages, _declared_blocks, _repeated_module_lists):
        paths = rule(component)
        if paths:
            return paths
    return []


def _unet_stages(component: nn.Module) -> list[str]:
    """A UNet's stages: `down_blocks.i`, `mid_block`, `up_blocks.i`. A ControlNet (down and mid, no up) too."""
    down, up = getattr(component, "down_blocks", None), getattr(component, "up_blocks", None)
    if not isinstance(down, nn.ModuleList) or callable(getattr(component, "decode", None)):
        return []
    mid = getattr(component, "mid_block", None)
    if not isinstance(up, nn.ModuleList) and not isinstance(mid, nn.Module):
        return []  # down_blocks alone is an encoder's layout, not a UNet's
    ups = [f"up_blocks.{i}" for i in range(len(up))] if isinstance(up, nn.ModuleList) else []
    return [f"down_blocks.{i}" for i in range(len(down))] + (["mid_block"] if isinstance(mid, nn.Module) else []) + ups


def _vae_stages(component: nn.Module) -> list[str]:
    """A VAE runs through encode() and decode(), not forward: its encoder's stages (down blocks, then the mid block)
    and its decoder's (the mid block, then the up blocks). A text-to-image pipeline never calls encode(): those
    targets stay idle (never called, left out of `Registration.all_tuned`); img2img and inpainting call both."""
    if not callable(getattr(component, "decode", None)):
        return []
    paths = []
    encoder = getattr(component, "encoder", None)
    if callable(getattr(component, "encode", None)) and isinstance(
        getattr(encoder, "down_blocks", None), nn.ModuleList
    ):
        paths += [f"encoder.down_blocks.{i}" for i in range(len(encoder.down_blocks))]
        paths += ["encoder.mid_block"] if isinstance(getattr(encoder, "mid_block", None), nn.Module) else []
    decoder = getattr(component, "decoder", None)
    if isinstance(getattr(decoder, "up_blocks", None), nn.ModuleList):
        paths += ["decoder.mid_block"] if isinstance(getattr(decoder, "mid_block", None), nn.Module) else []
        paths += [f"decoder.up_blocks.{i}" for i in range(len(decoder.up_blocks))]
    return paths


def _declared_blocks(component: nn.Module) -> list[str]:
    """Modules of the classes the component declares, each the child of an nn.ModuleList, outermost first."""
    classes = set(getattr(component, "_repeated_blocks", None) or []) or set(
        getattr(component, "_no_split_modules", None) or []
    )
    if not classes:
        return []
    modules = dict(component.named_modules())
    paths: list[str] = []
    for name, module in modules.items():
        if not name or type(module).__name__ not in classes:
            continue
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else component
        if not isinstance(parent, nn.ModuleList):
            continue
        if any(name.startswith(p + ".") for p in paths):
            continue  # inside a block already chosen
        paths.append(name)
    return paths


def _repeated_module_lists(component: nn.Module) -> list[str]:
    """The structural fallback for components that declare no blocks (HunyuanDiT, custom models).

    The outermost `nn.ModuleList`s whose children are two or more instances of one class, each with
    parameters and submodules of its own: never a list of tiny leaves (ControlNet's 1x1 convolutions), never
    the component itself. A list that does not qualify is searched inside.
    """
    paths: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            path = _join(prefix, child_name)
            if isinstance(child, nn.ModuleList) and _repeats_one_block(child):
                paths.extend(f"{path}.{i}" for i in range(len(child)))
            else:
                visit(path, child)

    visit("", component)
    return paths


def _repeats_one_block(modules: nn.ModuleList) -> bool:
    children = list(modules)
    return (
        len(children) >= 2
        and len({type(child) for child in children}) == 1
        and all(next(child.children(), None) is not None for child in children)  # not leaves
        and all(next(child.parameters(), None) is not None for child in children)
    )


def component_paths(name: str, component: nn.Module) -> list[str]:
    """The paths that run a component as a whole: a VAE's encoder and decoder (it runs through encode() and
    decode(); the encoder stays idle where encode() is never called), else the root."""
    if callable(getattr(component, "decode", None)) and isinstance(getattr(component, "decoder", None), nn.Module):
        encoder = getattr(component, "encoder", None)
        has_encoder = callable(getattr(component, "encode", None)) and isinstance(encoder, nn.Module)
        return ["encoder", "decoder"] if has_encoder else ["decoder"]
    return [""]


def find_targets(obj: Any, targets: TargetSelection = "blocks") -> list[FoundTarget]:
    """Resolve a target selection on a pipeline or model into concrete modules ("auto" starts as "components";
    `enable_aitune` then descends into the blocks of components that stay eager).

    Raises:
        UserInputError (a ValueError): an unknown mode string, a name that does not resolve, an empty selection.
        InputTypeError (a TypeError): a selection of the wrong type, a callable that returns something other
            than modules.
    """
    components = components_of(obj)
    if isinstance(targets, str):
        if targets not in MODES:
            raise unknown_targets(targets, components)
        rule = block_paths if targets == "blocks" else None
        found = []
        for prefix, component in components.items():
            paths = rule(component) if rule else component_paths(prefix, component)
            found += [
                FoundTarget(_join(prefix, p) or BARE_MODEL_NAME, component, p, component.get_submodule(p))
                for p in paths
            ]
    elif callable(targets):
        found = _from_callable(components, targets(obj))
    elif isinstance(targets, Iterable):
        found = [_resolve(components, name) for name in targets]
    else:
        raise InputTypeError(
            f"targets must be a string, a list of names or a callable, got {type(targets).__name__}: {targets!r:.60}"
        )
    if not found:
        raise UserInputError(
            f"targets={targets!r} found nothing to tune in this {type(obj).__name__}: no stages, no declared "
            f"blocks (_repeated_blocks / _no_split_modules) and no nn.ModuleList of repeated blocks; name modules "
            f"instead, e.g. targets=[{_examples(components)}], or use targets='components'"
        )
    return found


def unknown_targets(
    text: str, components: dict[str, nn.Module], names: str = "a list of dotted module names", callable_ok: bool = True
) -> UserInputError:
    """The error for a selection `text` that is neither a mode nor a module of `components` (`components_of`): the
    modes, how to name modules (`names`), real examples, a callable where the caller can pass one (`callable_ok`;
    the command line cannot), and a did-you-mean among the modes and the block names."""
    close = difflib.get_close_matches(text, [*MODES, *_valid_names(components)], n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    return UserInputError(
        f"unknown targets {text!r}; valid: {', '.join(map(repr, MODES))}, {names} (e.g. {_examples(components)})"
        f"{', or a callable' if callable_ok else ''}.{hint}"
    )


def _valid_names(components: dict[str, nn.Module]) -> list[str]:
    """The names an error offers: each component's blocks, or the component itself where it has none."""
    return [_join(p, s) for p, c in components.items() for s in block_paths(c) or [""]]


def _resolve(components: dict[str, nn.Module], name: Any) -> FoundTarget:
    if not isinstance(name, str):
        raise InputTypeError(f"target names are dotted strings, got {type(name).__name__}: {name!r}")
    for prefix, component in components.items():
        if not prefix and name == BARE_MODEL_NAME and not hasattr(component, BARE_MODEL_NAME):
            return FoundTarget(name, component, "", component)
        if prefix and name != prefix and not name.startswith(prefix + "."):
            continue
        path = name[len(prefix) + 1 :] if prefix and name != prefix else ("" if prefix else name)
        try:
            return FoundTarget(name, component, path, component.get_submodule(path))
        except AttributeError:
            break
    valid = _valid_names(components)
    close = difflib.get_close_matches(name, valid, n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise UserInputError(
        f"target {name!r} does not name a module here.{hint} Components: {', '.join(repr(p) for p in components)}; "
        f"blocks: {', '.join(valid[:12])}{' ...' if len(valid) > 12 else ''}"
    )


def _from_callable(components: dict[str, nn.Module], result: Any) -> list[FoundTarget]:
    """Accept a mapping name -> module or an iterable of modules; names come from where each module sits."""
    located = {
        id(module): (_join(prefix, path), component, path)
        for prefix, component in components.items()
        for path, module in component.named_modules()
    }
    if not isinstance(result, Mapping | Iterable):
        raise InputTypeError(
            f"the targets callable returned {type(result).__name__} ({result!r:.60}); it must return a list of "
            f"nn.Module instances or a mapping of name -> module"
        )
    items = list(result.items()) if isinstance(result, Mapping) else [(None, m) for m in result]
    found = []
    for given, module in items:
        if not isinstance(module, nn.Module):
            raise InputTypeError(
                f"the targets callable returned {type(module).__name__} ({module!r:.60}); it must return "
                f"nn.Module instances (or a mapping of name -> module)"
            )
        if id(module) not in located:
            raise UserInputError(
                f"the targets callable returned a {type(module).__name__} that is not part of this object"
            )
        name, component, path = located[id(module)]
        found.append(FoundTarget(given or name, component, path, module))
    return found


def _examples(components: dict[str, nn.Module], limit: int = 3) -> str:
    """Real names from this object to show in an error: blocks when there are any, else its submodules."""
    for prefix, component in components.items():
        paths = block_paths(component)
        if paths:
            return ", ".join(repr(_join(prefix, p)) for p in paths[:limit])
    names = [
        _join(prefix, path)
        for prefix, component in components.items()
        for path, _ in component.named_modules()
        if path and path.count(".") < 2
    ]
    names = names or [prefix for prefix in components if prefix]
    return ", ".join(repr(n) for n in names[:limit]) if names else "(this object has no submodules)"


def as_modules(found: list[FoundTarget]) -> dict[str, torch.nn.Module]:
    """Name -> module, in discovery order, for `aitune_hf.core.register`."""
    return {target.name: target.module for target in found}
