"""`AITunePipeline` / `AITuneModel`.from_pretrained, `enable_aitune(obj)`, and the cached dynamic subclasses.

The subclass of a concrete class ``C`` has bases ``(C, AITuneMixin)`` and keeps ``C``'s ``__name__``,
``__qualname__`` and ``__module__``: ``isinstance(obj, C)`` holds, ``save_pretrained`` writes the real class
name (a plain Diffusers / Transformers install reloads it), and class-keyed machinery keeps working. Its own
``__call__``, and ``generate`` / ``encode`` / ``decode`` where ``C`` has them, give the mixin the call boundaries
(`BOUNDARY_METHODS`); objects are re-classed in place, never copied.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aitune_hf.core.registration import Registration
from aitune_hf.errors import UserInputError
from aitune_hf.hf.copies import SUBCLASSES as _SUBCLASSES
from aitune_hf.hf.mixin import BOUNDARY_METHODS, AITuneMixin


def with_aitune(cls: type) -> type:
    """The cached subclass of `cls` with `AITuneMixin` applied (`cls` itself if it already has it)."""
    if issubclass(cls, AITuneMixin):
        return cls
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._aitune_call(super(subclass, self).__call__, args, kwargs)

    namespace: dict[str, Any] = {
        "__call__": __call__,
        # Copies and pickles are of `cls`, untuned, even where `cls` defines its own copy hooks.
        "__reduce_ex__": AITuneMixin.__reduce_ex__,
        "__copy__": AITuneMixin.__copy__,
        "__deepcopy__": AITuneMixin.__deepcopy__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    for method in BOUNDARY_METHODS:
        if callable(getattr(cls, method, None)):
            namespace[method] = _boundary(cls, method, lambda: subclass)
    if isinstance(getattr(cls, "components", None), property):  # a Diffusers pipeline: watch its components

        def __setattr__(self: Any, name: str, value: Any) -> None:
            super(subclass, self).__setattr__(name, value)
            if "_aitune_state" in self.__dict__:
                self._aitune_component_replaced(name)

        namespace["__setattr__"] = __setattr__
    subclass = type(cls.__name__, (cls, AITuneMixin), namespace)
    _SUBCLASSES[cls] = subclass
    return subclass


def _boundary(cls: type, method: str, subclass: Callable[[], type]) -> Callable[..., Any]:
    """`cls.method` as a whole call of the mixin (`subclass` gives the dynamic class once it exists)."""

    @functools.wraps(getattr(cls, method))
    def boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._aitune_call(getattr(super(subclass(), self), method), args, kwargs)

    return boundary


def apply_mixin(obj: Any) -> Any:
    """Re-class `obj` in place so that it has the mixin; returns `obj`."""
    obj.__class__ = with_aitune(type(obj))
    return obj


def enable_aitune(obj: Any, targets: Any = "blocks", **options: Any) -> Registration:
    """Enable aitune on a pipeline or model built elsewhere (re-classed in place); returns the Registration.

    All or nothing: when enabling raises (a bad option, a target that does not resolve), `obj` gets its own
    class back and nothing is patched.
    """
    cls = type(obj)
    try:
        return apply_mixin(obj).enable_aitune(targets, **options)
    except BaseException:
        if type(obj) is not cls:
            obj.__class__ = cls
        raise


def _enable_from(obj: Any, aitune: Mapping[str, Any] | bool | None) -> Any:
    apply_mixin(obj)
    if aitune:
        options = dict(aitune) if isinstance(aitune, Mapping) else {}
        obj.enable_aitune(options.pop("targets", "blocks"), **options)
    return obj


class AITunePipeline:
    """Loads a local Diffusers pipeline (or Transformers model) folder as its concrete class, mixin applied."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, aitune: Mapping[str, Any] | bool | None = None, **kwargs: Any) -> Any:
        """`DiffusionPipeline.from_pretrained(path, **kwargs)` re-classed with the mixin.

        A folder with a Transformers ``config.json`` (no ``model_index.json``) loads through `AITuneModel`.
        `aitune`: options for `enable_aitune` (e.g. ``{"targets": "blocks"}``) to enable right away.
        """
        if Path(path).is_dir() and folder_kind(path) == "transformers":
            return AITuneModel.from_pretrained(path, aitune=aitune, **kwargs)
        from diffusers import DiffusionPipeline

        return _enable_from(DiffusionPipeline.from_pretrained(path, **kwargs), aitune)


class AITuneModel:
    """Loads a Transformers model with any Auto class (``auto_class="AutoModelForMaskedLM"`` or the class)."""

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        auto_class: str | type = "AutoModel",
        aitune: Mapping[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """`auto_class.from_pretrained(path, **kwargs)` re-classed with the mixin."""
        import transformers

        if isinstance(auto_class, str):
            if not hasattr(transformers, auto_class):
                raise UserInputError(f"unknown Transformers auto class {auto_class!r} (e.g. 'AutoModel')")
            auto_class = getattr(transformers, auto_class)
        return _enable_from(auto_class.from_pretrained(path, **kwargs), aitune)


def folder_kind(path: str | Path) -> str:
    """'diffusers' or 'transformers' for a local model folder; `UserInputError` (a ValueError) otherwise."""
    folder = Path(path)
    if (folder / "model_index.json").exists():
        return "diffusers"
    config = folder / "config.json"
    if config.exists():
        try:
            data = json.loads(config.read_text())
        except json.JSONDecodeError as error:
            raise UserInputError(f"{config} is not JSON: {error}") from None
        if isinstance(data, dict) and "architectures" in data:
            return "transformers"
    raise UserInputError(f"{folder} holds neither a Diffusers pipeline (model_index.json) nor a Transformers model")
