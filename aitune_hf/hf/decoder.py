"""`openvino_decoder`: a causal LM's forward served whole by OpenVINO's stateful form (issue 47).

A decoder's step is a few milliseconds at the sizes users serve on a CPU, and most of it is matrix-vector products over
the weights, where OpenVINO's engine is about twice torch's (`benchmarks/results/generation_medium.md`: a 4-layer,
1024-wide Llama decodes at 1.90x eager through optimum-intel's stateful model, 1.06x through Transformers' compile
recipe, 1.64x through this backend). This backend builds that form from the model itself, as optimum-intel does,
without its package:

- **The model**: the whole `...ForCausalLM` traced by `torch.export` through a wrapper whose inputs are the token ids,
  the 2D attention mask, the positions and each layer's past keys and values (a `DynamicCache` made of them inside),
  and whose outputs are the logits, every layer's new keys and values (this call's rows) stacked in one tensor, and
  each layer's present ones;
  converted by OpenVINO's PyTorch frontend, the past inputs and present outputs turned into state variables (the KV
  cache kept inside the engine, `apply_make_stateful_transformation`), each starting empty for the call's batch.
- **Never stale**: the Hugging Face cache the model was given stays the source of truth. After every step this call's
  new rows go into it through `cache.update` (what eager does, so it grows exactly as eager's would); before a step,
  the engine's state is used only where it is known to equal that cache (the same object, the same length, its
  tensors not replaced or changed in place since our last step); otherwise it is loaded from the cache (a new
  `generate()`, the step after beam search reordered the cache, a cache another route or the user filled). Each
  calling thread has its own infer request and state. A served step starts on OpenVINO's thread and the route's guard
  is checked meanwhile (`_Stepper.start`); its rows reach the cache only when its output is taken, so a step cancelled
  because the guard failed leaves the cache as it was, for eager to run the step on.
- **Scope**: fp32 (the f32 hint, read back), and bf16 where asked for (first run in the build process, then served only
  through the end-to-end gate on the tokens); generate()'s default `DynamicCache`; a static cache, inputs
  embeddings, labels or an encoder-decoder model make it unavailable for that call, with the reason. Transformers
  5.25 and the 5.x releases before it that name the cache `past_key_values` (optimum-intel pins Transformers below 5.6).
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune_hf.backends.base import Backend, BuiltBackend, Call, register_backend
from aitune_hf.core.keys import state_fingerprint
from aitune_hf.core.weights import WeightValues
from aitune_hf.core.weights import _stamp as weight_stamp
from aitune_hf.errors import CandidateUnavailable, UserInputError

#: The precisions this backend computes in, and OpenVINO's hint for each (read back after compiling).
_HINTS = {"fp32": "f32", "bf16": "bf16"}

#: The forward's arguments a step may carry (each call's own values); any other one set makes the candidate unavailable.
_SERVED = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "return_dict"}
)
#: What a causal LM calls its cache, as an argument and as an output field: `cache` in Transformers 5.25,
#: `past_key_values` before (5.5, the release optimum-intel pins below 5.6); each step is read and answered in the
#: model's own names.
_CACHE_NAMES = ("cache", "past_key_values")


@register_backend
class OpenVinoDecoderBackend(Backend):
    """A causal LM's prefill and decode steps, whole, by OpenVINO with the KV cache kept as engine state."""

    name = "openvino_decoder"
    accepts_objects = True  # the KV cache, kept equal to eager's
    bakes_weights = True  # OpenVINO holds its own copy of the weights
    # Not `polymorphic`: the core tunes calls that hold a cache one signature at a time (their sizes are not all in
    # the signature), and its one-time check of a new shape would run eager and the build on the same cache.
    # A cheap build: torch.export of the whole model, its decompositions and OpenVINO's conversion take 7-10 s for a
    # 4-layer model, where Inductor compiles the prefill and the decode step in 20-30 s. Built first, its clear win over
    # eager skips Inductor: `generate()`'s one-off 8-9 s against 28-41 s, the decode step OpenVINO's on 1024-wide models
    # either way, and on 256-wide ones level with Inductor's (benchmarks/results/generation_cheap.md). (It was a slow
    # build while Inductor served small models' decode steps faster: 1.67x eager against 1.24x, before OpenVINO fused
    # the attention with the cache and the rotary embeddings.)
    build_cost = "cheap"
    builds_privately = True  # it traces a private copy (the live model keeps serving other threads)

    def __init__(self, num_threads: int | None = None, precision: str = "fp32") -> None:
        if precision not in _HINTS:
            raise UserInputError(f"openvino_decoder computes in {' or '.join(_HINTS)}, not precision={precision!r}")
        self.num_threads, self.precision = num_threads, precision

    def with_precision(self, precision: str) -> OpenVinoDecoderBackend | None:
        if precision == self.precision:
            return self
        return type(self)(self.num_threads, precision) if precision in _HINTS else None

    def describe(self) -> str:
        return self.name if self.precision == "fp32" else f"{self.name}(precision={self.precision})"

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        import transformers

        from aitune_hf.backends.openvino import OpenVinoBackend

        return {**OpenVinoBackend.versions(), "transformers": transformers.__version__, "aitune-hf decoder build": "4"}

    def unavailable_reason(self, devices: frozenset[torch.device]) -> str | None:
        import importlib.util

        if importlib.util.find_spec("openvino") is None:
            return "openvino is not installed (pip install 'aitune_hf[openvino]')"
        unsupported = sorted(str(d) for d in devices if d.type != "cpu")
        if unsupported:
            return f"the openvino_decoder backend runs on the CPU only, not on {', '.join(unsupported)}"
        return None

    def build(
        self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        signature = inspect.signature(forward)
        bound = _arguments(signature, *samples[0])
        cache = bound.get("cache")
        config = getattr(module, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(module, "get_decoder"):
            raise CandidateUnavailable("openvino_decoder serves a decoder-only causal LM (a ...ForCausalLM) whole")
        if type(cache) is not DynamicCache:
            raise CandidateUnavailable(
                f"openvino_decoder keeps generate()'s default DynamicCache in step, not a {type(cache).__name__} "
                "(a static cache: leave cache_implementation unset)"
            )
        kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
        if kinds:  # a sliding window crops what the engine's state would keep whole
            raise CandidateUnavailable(f"openvino_decoder keeps full-length layers in step, not {', '.join(kinds)}")
        extra = sorted(k for k, v in bound.items() if k not in _SERVED and v is not None and v is not False)
        if extra or not isinstance(bound.get("input_ids"), torch.Tensor):
            raise CandidateUnavailable(f"openvino_decoder serves calls of token ids only, not with {extra or 'embeds'}")
        keep = bound.get("logits_to_keep", 0)
        if not isinstance(keep, int):
            raise CandidateUnavailable("openvino_decoder keeps the last logits_to_keep logits as an int")
        from aitune_hf.backends.base import current_build
        from aitune_hf.backends.onnx.export import private_twin

        # One engine serves every signature of the model (a prefill and a decode step convert the same model): a
        # build of another signature reuses it where the module's state and weights are those it was made from
        # (`_MadeFrom`). The core checks it as any build; being the engine a fresh build would make, it is not built
        # again where that check fails (`BuiltBackend.identical`: a left-padded prefill, whose padded rows differ).
        key = (keep, self.precision, self.num_threads, signature)
        made = _MADE.get(module, {}).get(key) if current_build().state is not None else None
        if made is not None and made[0].holds(module):  # the engine itself: a fresh build would make the same one
            return BuiltBackend(fn=made[1], start=made[1].start, bakes_weights=True, reused=True, identical=True)
        weights = _MadeFrom(module)  # before the private copy is taken: the values the engine will hold
        twin, twin_forward = private_twin(module, forward)
        with torch.no_grad():  # on a copy of the sample: the run must not grow the sample's cache
            reference = twin_forward(**_arguments(signature, *copy.deepcopy(samples[0])))
        fields = [k for k, v in reference.items() if v is not None]
        if len(fields) != 2 or fields[0] != "logits" or fields[1] not in _CACHE_NAMES:
            raise CandidateUnavailable(f"openvino_decoder makes logits and the cache, this forward returns {fields}")
        compiled, layers = _compile(twin, keep, self.num_threads, self.precision, batch=bound["input_ids"].shape[0])
        stepper = _Stepper(compiled, signature, layers, type(reference), fields[1])
        with _MADE_LOCK:
            _MADE.setdefault(module, {})[key] = (weights, stepper)
        return BuiltBackend(fn=stepper, start=stepper.start, bakes_weights=True)


#: Per live model, the engine its last build of each kind made (`OpenVinoDecoderBackend.build`) and the weights it was
#: made from; held while the model lives.
_MADE: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[Any, ...], tuple[_MadeFrom, _Stepper]]] = (
    weakref.WeakKeyDictionary()
)
_MADE_LOCK = threading.Lock()


class _MadeFrom:
    """What an engine was made from: the module's state as guards see it (`core.keys.state_fingerprint`: structure,
    plain values; a LoRA layer added changes it), and its weights: the full weight check's values
    (`core.weights.WeightValues`: each floating tensor's L2 norm, the others exactly) and each tensor's version and
    storage (`core.weights._stamp`). `holds(module)`: a fresh build would make the same engine (up to an edit that keeps
    every norm, the full check's own blind spot, docs/guarantees.md)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._state = state_fingerprint(module)
        self._values = WeightValues(module)
        self._stamps = self._now()

    def _now(self) -> list[tuple[int | None, int]]:
        return [weight_stamp(table[key]) for _, table, key in self._values.places]

    def holds(self, module: torch.nn.Module) -> bool:
        """For `module`, the one it was made from (`_MADE`'s key)."""
        if self._now() != self._stamps or not self._values.holds():
            return False
        return state_fingerprint(module) == self._state


def _arguments(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (what **kwargs collected, flattened in)."""
    bound = signature.bind(*args, **kwargs)
    named = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    if "past_key_values" in named and "cache" not in named:
        named["cache"] = named.pop("past_key_values")
    return named


def _cache_argument(model: torch.nn.Module) -> str:
    """The name `model`'s forward takes its cache by (`_CACHE_NAMES`)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), _CACHE_NAMES[0])


def _compile(
    module: torch.nn.Module, keep: int, num_threads: int | None, precision: str = "fp32", batch: int = 1
) -> tuple[Any, int]:
    """The whole model as OpenVINO's stateful form, compiled in `precision` (see the module docstring); and its layer
    count. A reduced precision is first compiled and run (a prefill of `batch` rows and a decode step) in the build
    process: an engine that aborts its process costs the candidate there, never this process."""
    import numpy as np
    import openvino
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    from aitune_hf.backends.openvino import (
        OpenVinoBackend,
        _check_precision,
        _core,
        run_elsewhere_first,
        unmark_scalar_conversions,
    )

    config = module.config
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(module.parameters()).dtype
    step = _Step(module, layers, keep).eval()
    batch, length, past = 2, 3, 4  # an example of every size that varies (none of them 1: export specialises 1)
    example = (
        torch.randint(0, config.vocab_size, (batch, length)),
        torch.ones(batch, past + length, dtype=torch.long),
        torch.arange(past, past + length).expand(batch, length),
        [torch.zeros(batch, heads, past, head_dim, dtype=dtype) for _ in range(2 * layers)],
    )
    auto = torch.export.Dim.AUTO
    shapes = ({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto}, [{0: auto, 2: auto}] * (2 * layers))
    from aitune_hf.backends.onnx.export import exporting

    try:
        with torch.no_grad(), exporting():
            program = torch.export.export(step, example, dynamic_shapes=shapes, strict=False)
        model = openvino.convert_model(program)
    except Exception as error:  # an architecture the trace or the frontend does not take: this candidate's reason
        raise CandidateUnavailable(f"openvino_decoder could not trace or convert this model: {error}") from None
    unmark_scalar_conversions(model)  # the rotary embeddings fused (RoPE layers), as in the model read back from disk
    inputs = ["input_ids", "attention_mask", "position_ids", *(f"past.{i}" for i in range(2 * layers))]
    outputs = ["logits", "new", *(f"present.{i}" for i in range(2 * layers))]
    if len(model.inputs) != len(inputs) or len(model.outputs) != len(outputs):
        raise CandidateUnavailable("openvino_decoder: the converted model's inputs or outputs are not the wrapper's")
    for port, name in (*zip(model.inputs, inputs, strict=True), *zip(model.outputs, outputs, strict=True)):
        port.get_tensor().set_names({name})
    apply_make_stateful_transformation(model, {f"past.{i}": f"present.{i}" for i in range(2 * layers)})
    # Each state starts empty for the call's batch: (batch, heads, 0, head_dim), the batch read from the token ids; and
    # is read through a Gather by `beam_idx` (optimum-intel's cache reorder), the form OpenVINO's CPU plugin fuses with
    # the attention into one node that keeps the cache (StatefulSDPAFusion): without it each step's attention runs
    # as MatMul and Softmax over a concatenated cache (a 4-layer, 256-wide Llama's decode step: 1.9 ms against 0.42).
    rows = opset13.gather(opset13.shape_of(model.input("input_ids"), "i64"), opset13.constant([0]), opset13.constant(0))
    beam = opset13.parameter([-1], openvino.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    for op in [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]:
        sizes = [opset13.constant(np.array([size], dtype=np.int64)) for size in (heads, 0, head_dim)]
        shape = opset13.concat([rows, *sizes], axis=0)
        op.set_arguments([opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)), shape)])
        users = list(op.output(0).get_target_inputs())
        reordered = opset13.gather(op.output(0), beam, opset13.constant(0))
        for user in users:
            user.replace_source_output(reordered.output(0))
    model.add_parameters([beam])
    model.validate_nodes_and_infer_types()
    properties = OpenVinoBackend(precision=precision, num_threads=num_threads).config()
    # The fused attention keeps the cache in f16 unless told (lossy even under the f32 hint): the cache stays f32 in
    # every precision (the rows written back into generate()'s cache are the engine's, as it keeps them).
    properties["KV_CACHE_PRECISION"] = "f32"
    if precision != "fp32":
        prompt = 4
        ids = np.full((batch, prompt + 1), 1, dtype=np.int64)
        feeds = [
            {
                "beam_idx": np.arange(batch, dtype=np.int32),
                "input_ids": ids[:, :length] if past == 0 else ids[:, past:],
                "attention_mask": np.ones((batch, past + length), dtype=np.int64),
                "position_ids": np.tile(np.arange(past, past + length, dtype=np.int64), (batch, 1)),
            }
            for past, length in ((0, prompt), (prompt, 1))
        ]
        run_elsewhere_first(model, properties, feeds, f"OpenVINO's {precision} stateful model")
    compiled = _core().compile_model(model, "CPU", properties)
    _check_precision(compiled, _HINTS[precision])
    served = outputs[:2]  # what `_Stepper` reads, by index
    if [port.get_any_name() for port in compiled.outputs] != served:
        raise CandidateUnavailable("openvino_decoder: the stateful model's outputs are not the logits and the new rows")
    for name in ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION"):
        try:
            kept = str(compiled.get_property(name))
        except Exception:  # an OpenVINO without this property (older ones keep the cache as computed)
            continue
        if "32" not in kept:
            raise CandidateUnavailable(f"OpenVINO keeps the KV cache in {kept} ({name}) where f32 was asked for")
    return compiled, layers


class _Step(torch.nn.Module):
    """The traced step: a `DynamicCache` made of the past tensors, the model called on it, this call's rows (stacked
    in one output: one output per layer's keys and values cost the engine 4% of a 4-layer, 256-wide Llama's decode
    step, 0.358 against 0.344 ms, and 1% at 1024 wide) and the present tensors read back."""

    def __init__(self, model: torch.nn.Module, layers: int, keep: int) -> None:
        super().__init__()
        self.model, self.layers, self.keep = model, layers, keep
        self.cache_argument = _cache_argument(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # Filled directly: an empty layer's first update concatenates onto a 1-D empty tensor, which OpenVINO's
        # frontend cannot convert.
        new: list[torch.Tensor] = []
        for i, layer in enumerate(cache.layers[: self.layers]):
            layer.device = past[0].device
            layer.keys, layer.values = past[2 * i], past[2 * i + 1]
            layer.is_initialized = True
            layer.update = _recording(layer.update, new)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=self.keep,
            **{self.cache_argument: cache},
        )
        present = [t for layer in cache.layers[: self.layers] for t in (layer.keys, layer.values)]
        return (out.logits, torch.stack(new), *present)


def _recording(update: Callable[..., Any], new: list[torch.Tensor]) -> Callable[..., Any]:
    """A cache layer's `update` that also records the rows it is given: this step's keys and values, taken before
    they are concatenated (a slice of the concatenation would be a third reader of it, which stops OpenVINO fusing the
    attention with the cache)."""

    def update_and_record(keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        new.extend((keys, values))
        return update(keys, values, *args, **kwargs)

    return update_and_record


class _Stepper:
    """The built callable: one step on this thread's infer request, its state checked against the cache first."""

    def __init__(self, compiled: Any, signature: inspect.Signature, layers: int, output: type, field: str) -> None:
        self._compiled, self._signature, self._layers, self._output = compiled, signature, layers, output
        self._field = field  # the output's name for the cache (`_CACHE_NAMES`)
        self._local = threading.local()
        #: Each input's index in the compiled model (the feed is given by index: no lookup by name per step).
        self._inputs = {port.get_any_name(): index for index, port in enumerate(compiled.inputs)}
        self._beams: dict[int, Any] = {}  # per batch size, `beam_idx` (the cache's own order), made once

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import openvino

        request, feeds, cache, end = self._begin(args, kwargs)
        # The engine's own `infer` (`openvino.InferRequest`'s base): the Python wrapper also copies every output into
        # new arrays (`share_outputs=False`) and dispatches the feed by type, 0.27 ms of a 4-layer, 256-wide Llama's
        # 1.61 ms decode step on an Ice Lake Xeon (1.34 ms through the engine's own, medians of 15 rounds of 39
        # steps). The outputs are read by `_finish` from the request's own tensors.
        super(openvino.InferRequest, request).infer(feeds, True, True)
        return self._finish(request, cache, end)

    def start(self, *args: Any, **kwargs: Any) -> _StepStarted:
        """Begin the step on OpenVINO's own thread (`BuiltBackend.start`): the caller's thread checks the route's guard
        meanwhile, which costs a whole model's step 0.24-0.25 ms on the caller's thread otherwise (a 4-layer, 256-wide
        Llama or Qwen3 decoding at 2.56 ms a token on an Ice Lake Xeon: a tenth of it)."""
        import openvino

        request, feeds, cache, end = self._begin(args, kwargs)
        super(openvino.InferRequest, request).start_async(feeds, None)  # the base's: no dispatch of the feed by type
        return _StepStarted(self, request, cache, end, feeds)

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[int, Any], Any, int]:
        """This thread's infer request with its state made equal to the call's cache, the feed, the cache and its
        length after the step. The engine's state is unknown (`seen` None) until `_finish` records the step: a step
        that raised or was cancelled leaves it reloaded from the cache next time."""
        import numpy as np
        import openvino

        # generate() passes keywords only: no binding (a tenth of the step's overhead)
        named = _arguments(self._signature, args, kwargs) if args else kwargs
        ids = named["input_ids"]
        cache = named["cache"] if "cache" in named else named["past_key_values"]
        batch, length = ids.shape
        past = cache.get_seq_length()
        mask = named.get("attention_mask")
        if mask is None:
            mask = torch.ones(batch, past + length, dtype=torch.long)
        positions = named.get("position_ids")
        if positions is None:  # as the model computes them without: the cache's length on
            positions = torch.arange(past, past + length).expand(batch, length)
        local = self._local
        if getattr(local, "request", None) is None:
            local.request, local.seen = self._compiled.create_infer_request(), None
        request = local.request
        if past == 0:
            request.reset_state()
        elif local.seen != (weakref.ref(cache), past, _stamp(cache)):  # not the state this engine holds: load it
            states = {state.name: state for state in request.query_state()}
            for i, layer in enumerate(cache.layers[: self._layers]):
                for j, tensor in enumerate((layer.keys, layer.values)):
                    data = np.ascontiguousarray(tensor.detach().numpy())
                    states[f"past.{2 * i + j}present.{2 * i + j}"].state = openvino.Tensor(data)  # OpenVINO's name
        local.seen = None
        beams = self._beams.get(batch)
        if beams is None:  # the cache's own order (a reorder reloads the state above)
            beams = self._beams[batch] = openvino.Tensor(np.arange(batch, dtype=np.int32))
        index, tensor = self._inputs, openvino.Tensor
        feeds = {
            index["beam_idx"]: beams,
            index["input_ids"]: tensor(np.ascontiguousarray(ids.to(torch.long).numpy()), shared_memory=True),
            index["attention_mask"]: tensor(np.ascontiguousarray(mask.to(torch.long).numpy()), shared_memory=True),
            index["position_ids"]: tensor(np.ascontiguousarray(positions.to(torch.long).numpy()), shared_memory=True),
        }
        return request, feeds, cache, past + length

    def _finish(self, request: Any, cache: Any, end: int) -> Any:
        """The step's output, its new rows put into the call's cache (`cache.update`, as eager grows it)."""
        output = request.get_output_tensor
        # A view of the request's buffer: `update` concatenates its rows into new tensors before the next step.
        rows = torch.from_numpy(output(1).data)
        for i in range(self._layers):
            cache.update(rows[2 * i], rows[2 * i + 1], i)
        self._local.seen = (weakref.ref(cache), end, _stamp(cache))
        return self._output(logits=torch.from_numpy(output(0).data.copy()), **{self._field: cache})


class _StepStarted:
    """A step running on OpenVINO's thread (`_Stepper.start`); it holds the arrays the engine reads until it ends."""

    __slots__ = ("_cache", "_end", "_feeds", "_request", "_stepper")

    def __init__(self, stepper: _Stepper, request: Any, cache: Any, end: int, feeds: dict[int, Any]) -> None:
        self._stepper, self._request, self._cache, self._end, self._feeds = stepper, request, cache, end, feeds

    def result(self) -> Any:
        self._request.wait()
        return self._stepper._finish(self._request, self._cache, self._end)

    def cancel(self) -> None:
        """Its output is not wanted (the route's guard failed): the cache is left as it was, and the engine's state,
        unknown, is loaded from the cache at this thread's next step."""
        from aitune_hf.backends.openvino import cancel_request

        cancel_request(self._request)


def _stamp(cache: Any) -> tuple[Any, ...]:
    """What changes when a cache's tensors are replaced (beam search's reorder) or written in place."""
    return tuple((id(t), t._version) for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
