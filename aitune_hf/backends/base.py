"""The backend protocol and the name -> class registry.

A backend knows one technology and nothing of Hugging Face or of the tuning core: it receives a module,
the forward to reproduce, and sample calls as plain ``(args, kwargs)`` pairs, and returns a callable.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import io
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from aitune_hf.errors import InputTypeError, TuningError, UserInputError

logger = logging.getLogger(__name__)

Call = tuple[tuple[Any, ...], dict[str, Any]]
#: Call leaves that are plain values (compared and copied by value); a leaf that is neither one of these nor a
#: tensor is an object input (a KV cache), which only backends with `accepts_objects` take.
PLAIN_VALUES = (bool, int, float, str, type(None), torch.dtype, torch.device)
#: The numeric precisions a build may compute in: "fp32" computes as the module does (within fp32 tolerances); the
#: others are reduced precision, opt-in (`TuningConfig.precision`).
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


@dataclass
class BuiltBackend:
    """What `Backend.build` returns: the callable that replaces the forward, and what it baked in."""

    fn: Callable[..., Any]
    bakes_weights: bool = False
    artifacts: list[Path] = field(default_factory=list)
    #: Writes `artifacts` when the cache stores this build as a decision (`core.cache`), rather than at build time: for
    #: a backend whose writing holds the GIL (OpenVINO's `export_model`), only a build that wins writes, and the
    #: candidates a search builds beside the callers' calls write nothing. None: written by `build` already.
    write_artifacts: Callable[[], None] | None = None
    #: For a build with `dynamic=True`: per tensor leaf of the call (in pytree order), the dimensions whose size
    #: may differ from the samples'; every other dimension must match. None: the samples' exact shapes only.
    dynamic_dims: tuple[frozenset[int], ...] | None = None
    #: A count that grows whenever the callable ran (part of) a call in another way than built (Dynamo running a
    #: frame eager): the core reads it around each new shape's one-time check. None: it never does.
    fell_back: Callable[[], int] | None = None
    #: The artifact was read from a cache (`ArtifactPlace.load`) rather than built here.
    loaded: bool = False
    #: Made from an earlier build's work in this process (`BuildContext.sibling`, `BuildContext.state`) with this
    #: module's weights put in, not built afresh: if it fails its check, the core builds again without reuse.
    reused: bool = False
    #: With `reused`: the earlier build itself, made from this very module state and these weights (verified), which a
    #: fresh build would make again: where it fails its check, the core does not build again.
    identical: bool = False
    #: Begins a call on the backend's own threads (`Started`); None: the backend computes on the caller's thread. The
    #: core starts a route's call this way before it checks the route's guard, so the check costs the caller no time,
    #: and takes the output only where the guard holds (else it cancels the call): `Target.call`, and
    #: `TuningJob.serving` as timed.
    start: Callable[..., Started] | None = None
    #: What the build computes otherwise than its backend's name says, for the report (an int8 build whose runtime
    #: keeps some layers in a float precision on this CPU: which ones); None: nothing to say.
    note: str | None = None


class Started(Protocol):
    """A call running on a backend's own threads (`BuiltBackend.start`), owned by the thread that started it."""

    def result(self) -> Any:
        """Wait for the call and return its output (raising what it raised)."""

    def cancel(self) -> None:
        """Its output is not wanted: stop it where the backend can, and return once it no longer runs."""


class ArtifactPlace(abc.ABC):
    """Where a build finds a cached artifact and where it writes the one it makes: set by the tuning core around
    the builds of one tuning (`build_context(place=...)`), read by backends that persist what they build (ONNX models).
    A backend that finds nothing here builds as it would without a cache."""

    @abc.abstractmethod
    def load(self, backend: Backend, bakes_weights: bool) -> Path | None:
        """A local folder holding this backend's artifact for the module being tuned, already checked against
        its manifest (and, when `bakes_weights`, made for the module's current weights); None: build afresh."""

    @abc.abstractmethod
    def save(self) -> Path:
        """A fresh, empty local folder to write a new artifact into (published if this build wins)."""


_WORKER = threading.local()


@contextlib.contextmanager
def on_the_worker() -> Iterator[None]:
    """Marks the calling thread as aitune_hf's worker while inside (`core/background.py` runs each job in it): what it
    runs of a built backend is a tuning's, not a caller's (the checks of new shapes, the timed rounds of a search)."""
    prior = getattr(_WORKER, "on", False)
    _WORKER.on = True
    try:
        yield
    finally:
        _WORKER.on = prior


def running_on_the_worker() -> bool:
    """True in aitune_hf's worker thread while it runs a job (`on_the_worker`). A built backend whose engine runs one
    request at a time gives the worker a copy of its own (`backends/openvino.py`): a caller's request then never waits
    for the worker's, nor the worker's timed runs for a caller's."""
    return getattr(_WORKER, "on", False)


@dataclass(frozen=True)
class BuildContext:
    """What the tuning core tells the builds of one tuning, besides their arguments (`build_context`).

    Attributes:
        place: where builds read cached artifacts and write new ones (the persistent cache), or None.
        shared: scratch space for the builds of one tuning (see the field).
        sibling: the module is an identical sibling of one built before (same class, weight shapes, call), whose
            decision the core is applying: a backend may reuse that build's work with this module's weights
            (ONNX Runtime reuses the export). The core checks the result against eager as any build, and
            builds afresh, without this flag, if the check fails.
        state: returns (computed on first call) a digest of the module being tuned as the core guards it
            (`core.keys.build_state`: structure, plain values, memory layout, training; the recorded calls'
            signatures and modes; not weight values); None outside the core. Builds of modules with equal digests
            in this process may reuse each other's work with this module's weights (ONNX Runtime reuses the
            export): a block tuned again (after `disable_aitune`, a weight edit, another precision) or a second
            pipeline of the same architecture exports nothing. Checked, and rebuilt afresh on failure, as `sibling`.
    """

    place: ArtifactPlace | None = None
    sibling: bool = False
    state: Callable[[], str] | None = None
    #: Scratch space shared by the builds of one tuning of one module (None outside one): a reduced-precision variant
    #: reuses there what the fp32 build of the same backend made (ONNX Runtime's int8 variant: the fp32 export).
    shared: dict[Any, Any] | None = None
    #: Build only from a private copy of the module (background tuning): a backend that would have to work on the
    #: live module raises instead.
    private_only: bool = False
    #: The eager outputs of the calls the build is given, by the identity of each call (`TuningJob` replayed them for
    #: its references), so that a build needs no forward of its own to learn the output's structure (`CallLayout.of`:
    #: a whole MiniLM at batch 32 is 0.9 s a forward); empty where none was kept.
    outputs: Mapping[int, Any] = field(default_factory=dict)


_BUILD: contextvars.ContextVar[BuildContext] = contextvars.ContextVar("aitune_hf_build", default=BuildContext())  # noqa: B039 (frozen)


@contextlib.contextmanager
def build_context(**changes: Any) -> Iterator[None]:
    """Builds inside this block (in this thread) see `current_build()` with `changes` applied."""
    token = _BUILD.set(dataclasses.replace(_BUILD.get(), **changes))
    try:
        yield
    finally:
        _BUILD.reset(token)


def current_build() -> BuildContext:
    return _BUILD.get()


class Backend(abc.ABC):
    """One way of running a module's forward. Subclasses set `name` and implement `build`."""

    name: str = ""
    #: True when the built callable holds its own copy of the weights (edits to the module go unseen).
    bakes_weights: bool = False
    #: True when the built callable supports autograd (so it may serve calls with grad enabled).
    supports_autograd: bool = False
    #: True when the built callable takes inputs that are objects (a KV cache) and honours their side effects.
    accepts_objects: bool = False
    #: True when `build(..., dynamic=True)` makes one callable for a shape family (see `build`).
    polymorphic: bool = False
    #: The precision the built callable computes in (`PRECISIONS`): "fp32" for every backend unless a reduced-precision
    #: variant (`with_precision`) was asked for.
    precision: str = "fp32"
    #: True when `build` works on a private copy of the module (the live one keeps serving other threads untouched, as
    #: background tuning needs); False for a compiler that traces the live module.
    builds_privately: bool = False
    #: "cheap" (seconds a block: an export, a graph capture) or "slow" (a compiler: tens of seconds a block; measured
    #: on this project's CPUs: Inductor 5-30 s for a small block, the ONNX export 1-5 s). Strategies try cheap builds
    #: first and skip slow ones where a cheap winner is clear (`core.strategy_base.cheap_first`). "quick": a cheap
    #: build that reads no export (OpenVINO's trace door: no export to wait for, where a whole MiniLM's took 8-10 s),
    #: tried first of the cheap ones on a whole model (`Target.whole`), where anytime tuning looks for its first plan.
    build_cost: str = "cheap"
    #: The intermediate form a build reads where the builds of one tuning share it, or None (a form of its own):
    #: "onnx", the ONNX export, made once per module state and reused by every build that reads it (ONNX Runtime,
    #: OpenVINO's ONNX door). Once one of them is built the others cost little (on a whole MiniLM: the export 8 s,
    #: OpenVINO from it 1.3 s), so anytime tuning builds and checks them together and times first the one its check
    #: showed fastest (`core.strategy.MinLatency`).
    reads: str | None = None

    def with_precision(self, precision: str) -> Backend | None:
        """This backend computing in `precision` (a new instance with the same options), or None when it has no such
        variant. The variant's `describe()` names the precision."""
        return self if precision == self.precision else None

    def variants(self) -> list[Backend]:
        """Other forms of this backend in the same precision, each a candidate of its own in every tuning, whatever the
        precision asked for (new instances, each `describe()` naming its form): OpenVINO's other doors, its PyTorch
        frontend reading a `torch.export` program or a TorchScript trace (`OpenVinoBackend(door=...)`).
        Reduced-precision variants (`with_precision`) are made of each of them. Default: none."""
        return []

    def kernel_variants(self) -> list[Backend]:
        """Other kernel choices of this backend in the same precision (new instances, each `describe()` naming its
        choice), which `TuningConfig(precision="auto")` offers beside it: ONNX Runtime's fused kernels
        (`kernels="fused"`). A variant that finds nothing to do in a block raises `errors.CandidateUnavailable` from
        `build`. Default: none."""
        return []

    def unavailable_reason(self, devices: frozenset[torch.device]) -> str | None:
        """Why this backend cannot run on `devices`, or None when it can."""
        return None

    def cannot_win(
        self,
        timed: Sequence[tuple[str, str, float | None]],
        elsewhere: Mapping[str, Sequence[tuple[str, str, float | None]]] | None = None,
    ) -> str | None:
        """Why this candidate is not worth building for a target where `timed` was measured (each candidate timed there:
        its `describe()`, precision and speed-up over eager), or None: an evidence rule, asked by the search after a
        first plan (`core/refine.py`) before it builds this candidate; the report keeps the reason. `elsewhere`: what
        the targets of the same registration searched before this one timed (by target name, in the order they were
        timed; `core.strategy.KindEvidence`). Default: None."""
        return None

    #: Modules a build of this backend imports in the build process (`run_in_build_process`), imported there when it
    #: starts early (`warm_build_process`) rather than by the first background build.
    build_process_imports: tuple[str, ...] = ()

    def prepare(self) -> None:
        """Import now what `build` will import in this process (a backend imports its technology only when it first
        builds). `register()` calls it for background tuning (`TuningConfig.background`), before any call is served:
        an import holds the GIL for long stretches (loading a compiled extension, building protobuf descriptors), and
        a build in the background would otherwise make it while requests are served. Default: nothing."""
        return None

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        """The packages this backend's builds depend on beyond torch, with their installed versions (None where not
        installed), and the revision of any rewrite of its own that changes what a build computes: each is a part of
        every cache key (`core/keys.py`), so that an upgrade tunes again."""
        return {}

    @abc.abstractmethod
    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        """Build a callable equivalent to ``forward`` for calls shaped like ``samples`` (one signature).

        Must not change ``module``, even for a moment: other threads keep calling it eagerly while it builds
        (a tracer that swaps parameters, as ``torch.export`` does, must work on a copy).

        A backend with ``polymorphic = True`` also takes ``dynamic=True``: ``samples`` then belong to one shape
        family (equal structure, ranks, dtypes, devices and plain values; tensor sizes may differ), and the
        callable must serve calls of the family whose tensors differ only in the sizes of the dimensions it
        names in ``BuiltBackend.dynamic_dims``. The tuning core checks it against eager on each new shape once
        before serving it."""

    def describe(self) -> str:
        """The name shown in reports (options included)."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


_BUILTIN: dict[str, str] = {
    "eager": "aitune_hf.backends.eager:EagerBackend",
    "inductor": "aitune_hf.backends.inductor:InductorBackend",
    "onnxruntime": "aitune_hf.backends.onnxruntime:OnnxRuntimeBackend",
    "openvino": "aitune_hf.backends.openvino:OpenVinoBackend",
}
_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: make a backend reachable by its `name`."""
    if not cls.name:
        raise UserInputError(f"{cls.__qualname__} must set a non-empty `name` to be registered, got {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def backend_classes() -> list[type[Backend]]:
    """Every backend class `get_backend` reaches, the built-in ones imported (a backend imports its technology only
    when it builds)."""
    for name in _BUILTIN:
        if name not in _REGISTRY:
            module_name, class_name = _BUILTIN[name].split(":")
            _REGISTRY[name] = getattr(importlib.import_module(module_name), class_name)
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


@functools.cache
def installed_version(package: str) -> str | None:
    """The installed version of distribution `package`, or None (for `Backend.versions`)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def default_backend_names() -> tuple[str, ...]:
    """The candidates tried when none are named (`TuningConfig.backends`): Inductor, ONNX Runtime and, where it is
    installed (the `openvino` extra), OpenVINO; whole-component candidates (`component_backends`) are the ONNX
    runtimes among them. Naming "openvino" without it installed is an error; leaving it out of the default is not."""
    return ("inductor", "onnxruntime", *(("openvino",) if importlib.util.find_spec("openvino") is not None else ()))


def backend_names() -> list[str]:
    """Every backend name that `get_backend` accepts."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def get_backend(spec: str | Backend) -> Backend:
    """A backend instance from a name (default options) or an instance (returned as is)."""
    if isinstance(spec, Backend):
        return spec
    if not isinstance(spec, str):
        raise InputTypeError(f"a backend is a name or a Backend instance, got {type(spec).__name__}: {spec!r}")
    if spec not in _REGISTRY and spec in _BUILTIN:
        module_name, class_name = _BUILTIN[spec].split(":")
        _REGISTRY[spec] = getattr(importlib.import_module(module_name), class_name)
    if spec not in _REGISTRY:
        raise UserInputError(f"unknown backend {spec!r}; valid names: {', '.join(backend_names())}")
    return _REGISTRY[spec]()


# -- the build process: a private build's heavy steps outside this process --------------------------------------------
#
# Why: in background tuning (issue 20) a build shares the process with the threads that serve requests, and C++ steps
# of a build (an ONNX export's serialisation, a quantization, ONNX Runtime's graph optimisation) hold the GIL for up
# to seconds, which no yielding in Python can break up: a request then waits for them. Run there, they cost the
# serving threads a core at most, never the GIL.
#
# One worker per process, started on first use and kept (its start, an interpreter importing torch, is paid once),
# ended at exit or when this process's end closes its pipe. Its own interpreter, started with `subprocess` and not
# `multiprocessing`: the spawn start method would import this process's main module again in the worker (a serving
# framework's worker script, a notebook), and fork would copy the threads' locks. It runs one torch thread, at a
# lower priority (nice 10), with no GPU visible: it builds for CPUs only. Calls are serialised (one tuning at a time
# in the process, as ever); what it returns is plain data (paths, numbers).

BUILD_PROCESS_NICE = 10
# The worker adds the entries of this process's import path that it lacks (a serving framework's working directory, a
# test's root) before its first import; each call sends the path again, for entries added since.
_WORKER_MAIN = (
    "import json, sys; sys.path[:0] = [p for p in json.loads(sys.argv[3]) if p not in sys.path]; "
    "from aitune_hf.backends.base import _serve_builds; _serve_builds()"
)
_worker_lock = threading.Lock()
_worker: subprocess.Popen[bytes] | None = None
_worker_pipes: tuple[Any, Any] | None = None  # (to the worker, from the worker): multiprocessing Connections


class _OutOfBand(pickle.Pickler):
    """Pickles a CPU tensor's storage as a buffer out of band (`pickle_out_of_band`), not as bytes made by
    `torch.save` inside the pickle."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage  # (the public `untyped()` warns that TypedStorage goes away)
            if untyped.device.type == "cpu" and untyped.nbytes() > 0:
                with torch.no_grad():
                    data = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy()
                return _storage_from_buffer, (pickle.PickleBuffer(data), obj.dtype)
        return NotImplemented


def pickle_out_of_band(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """`obj` pickled with its CPU tensors' data out of band: the pickle, and the buffers (sharing the tensors'
    memory) to load it with (`pickle.loads(data, buffers=...)`). Handed to `run_in_build_process`, the buffers go down
    the pipe as they are. Pickled in band, a tensor's storage is written by `torch.save` into bytes, and those bytes
    copied into the pickle and again into the message, all holding the GIL: a whole MiniLM's private copy stalled the
    callers' calls 0.15-0.25 s in the message, 0.04-0.13 s more in `torch.save`."""
    stream = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _OutOfBand(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), buffers


def _storage_from_buffer(buffer: Any, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """A storage of its own (a copy: each load of a pickle is a fresh copy) from an out-of-band buffer."""
    import numpy

    data = torch.from_numpy(numpy.frombuffer(buffer, dtype=numpy.uint8).copy())
    return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)


def run_in_build_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in this process's build worker (see above); returns its result.

    `fn` and `args` go by pickle: `fn` a module-level function, the arguments anything the worker can unpickle
    with this process's `sys.path` (a class defined in `__main__` or inside a function cannot). `pickle.PickleBuffer`s
    among them (`pickle_out_of_band`) go out of band: written to the pipe from their memory (the GIL let go while it
    writes), and arrive as bytes. Raises what pickling raises (nothing started then) and `TuningError` when `fn`
    raised in the worker or the worker ended; the worker is started again on the next call."""
    global _worker, _worker_pipes
    buffers: list[pickle.PickleBuffer] = []
    call = pickle.dumps((fn, args), protocol=5, buffer_callback=buffers.append)
    message = pickle.dumps((list(sys.path), call, len(buffers)), protocol=5)
    with _worker_lock:
        if _worker is None or _worker.poll() is not None:
            _start_build_process()
        assert _worker is not None and _worker_pipes is not None
        to_worker, from_worker = _worker_pipes
        try:
            to_worker.send_bytes(message)
            for buffer in buffers:
                to_worker.send_bytes(buffer.raw())
            reply = from_worker.recv_bytes()  # waits without the GIL
        except BaseException as error:  # the worker died, or this thread was interrupted mid-call: start afresh
            code = _stop_build_process()
            if isinstance(error, Exception):
                raise TuningError(f"the build process ended ({_exit_text(code)}) before it answered") from error
            raise
    status, value = pickle.loads(reply)
    if status != "ok":
        raise TuningError(f"in the build process: {value}")
    return value


def warm_build_process(modules: Sequence[str]) -> threading.Thread | None:
    """Start the build process now and import `modules` there (each that imports; the others are skipped), on a daemon
    thread; returns it, or None where the build process runs already or is being warmed. A search after a first plan
    (anytime tuning) builds there from its first step: started at registration, its imports (torch, the runtimes, the
    model's classes: about 3.3 s on a 2-core AMD EPYC, then the first `torch.export`) overlap the tuning call instead of
    delaying the search's first build (the torch.export door's first MiniLM build took 13 s, 4.5 s of it the work)."""
    global _warming
    with _warm_lock:
        if _warming or (_worker is not None and _worker.poll() is None):
            return None
        _warming = True

    def warm() -> None:
        global _warming
        try:
            run_in_build_process(_import_here, list(modules))
        except Exception:  # started again by the first build that needs it
            logger.debug("aitune_hf: the build process could not be started early", exc_info=True)
        finally:
            _warming = False

    thread = threading.Thread(target=warm, name="aitune_hf build process start", daemon=True)
    thread.start()
    return thread


def _import_here(modules: list[str]) -> list[str]:
    """In the build process: import each of `modules` that imports; the names of those that did."""
    imported = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            continue
        imported.append(name)
    return imported


_warm_lock = threading.Lock()
_warming = False


def build_process_pid() -> int | None:
    """The build worker's process id while it runs, else None (without waiting for a build in progress)."""
    worker = _worker
    return worker.pid if worker is not None and worker.poll() is None else None


def _start_build_process() -> None:
    global _worker, _worker_pipes
    from multiprocessing.connection import Connection

    to_read, to_write = os.pipe()  # this process -> worker
    from_read, from_write = os.pipe()  # worker -> this process
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",  # never initialise a GPU: the worker builds for CPUs only
    }
    try:
        _worker = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN, str(to_read), str(from_write), json.dumps(sys.path)],
            pass_fds=(to_read, from_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=env, start_new_session=True,  # a Ctrl-C of the terminal is this process's
        )  # fmt: skip
    except BaseException:
        for fd in (to_read, to_write, from_read, from_write):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):  # the worker's ends (closed above when Popen failed)
            os.close(to_read)
            os.close(from_write)
    _worker_pipes = (Connection(to_write, readable=False), Connection(from_read, writable=False))
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_stop_build_process_at_exit)
        _atexit_registered = True


_atexit_registered = False


def _exit_text(code: int | None) -> str:
    """A worker's exit code as a reader wants it: "exit code 1", "killed by SIGFPE"."""
    if code is not None and code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _stop_build_process() -> int | None:
    """Closes the pipes (the worker ends when it reads their end) and reaps the worker; its exit code."""
    global _worker, _worker_pipes
    worker, pipes = _worker, _worker_pipes
    _worker = _worker_pipes = None
    for pipe in pipes or ():
        pipe.close()
    if worker is None:
        return None
    try:
        return worker.wait(timeout=5)
    except subprocess.TimeoutExpired:  # busy with a build nobody waits for any more
        worker.kill()
        return worker.wait()


def _stop_build_process_at_exit() -> None:
    """Ends the worker without the lock: a daemon tuning thread may hold it, waiting for a build that nobody needs
    any more (its wait then ends with the pipe)."""
    worker = _worker
    if worker is not None and worker.poll() is None:
        worker.kill()
        worker.wait()


def _serve_builds() -> None:
    """The worker's loop: a call per message, until the pipe from the parent ends."""
    from multiprocessing.connection import Connection

    with contextlib.suppress(OSError):
        os.nice(BUILD_PROCESS_NICE)
    torch.set_num_threads(1)
    inbox = Connection(int(sys.argv[1]), writable=False)
    outbox = Connection(int(sys.argv[2]), readable=False)
    while True:
        try:
            message = inbox.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            path, call, count = pickle.loads(message)
            buffers = [inbox.recv_bytes() for _ in range(count)]
            sys.path[:0] = [entry for entry in path if entry not in sys.path]
            fn, args = pickle.loads(call, buffers=buffers)
            reply: tuple[str, Any] = ("ok", fn(*args))
        except BaseException as error:  # reported to the parent, which falls back to building itself
            reply = ("error", f"{type(error).__name__}: {error}")
        try:
            data = pickle.dumps(reply)
        except Exception as error:
            data = pickle.dumps(("error", f"the result cannot be pickled: {error}"))
        outbox.send_bytes(data)
