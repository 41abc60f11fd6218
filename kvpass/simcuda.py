"""A simulated CUDA device: tensors that report ``device="cuda"`` and keep their data in CPU memory.

Test and tool infrastructure (``kvpass check --device simulated-cuda``, tests/test_simcuda.py): the
library never imports it. Inside ``with SimCuda() as sim:``

- :class:`SimTensor` (a wrapper subclass, FakeTensor's design with real data underneath) reports
  ``cuda:0``; every aten op on it runs on the CPU tensor inside, so ``t.is_cuda`` branches of kvpass
  (``lowering/dispatch.py``: the Triton kernels) run here. Triton launches run under
  ``TRITON_INTERPRET=1``: the interpreter's launcher is given the CPU tensors underneath.
- every aten op checks that its tensor arguments share one device (0-dim CPU tensors allowed, as on
  CUDA); an op that mixes devices raises :class:`SimCudaError` naming the op and the kvpass frame.
- host-device copies are counted (:class:`Copy`: bytes, direction, pinned, ``non_blocking``); a
  ``non_blocking`` copy from unpinned host memory is an error.
- ``torch.cuda.is_available`` / ``Stream`` / ``Event`` / ``current_stream`` / ``stream`` have stand-ins
  that record order: reading on one stream a buffer that another stream wrote, with no ``wait_event`` /
  ``wait_stream`` in between, is an error.
- :func:`sim_compile` compiles a dynamo graph as kvpass's backend does (the same passes on the post-grad
  graph Inductor makes for CUDA inputs) and runs the post-grad graph by FX: Inductor's CUDA code
  generation needs a driver.

Errors are recorded in ``sim.errors`` and raised at once (``raise_errors=True``, the default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from typing import Any, Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SimCuda", "SimTensor", "SimCudaError", "Copy", "to_sim", "from_sim", "sim_backend", "sim_module"]

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
_ACTIVE = threading.local()  # the SimCuda of this thread (set while its block runs)

# ops that move data between devices: the only ones allowed to mix them
_COPIES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
           aten._copy_from_and_resize.default}
# ops that only read metadata of a host tensor: allowed beside device tensors
_META = {aten.is_pinned.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
         aten.sym_storage_offset.default, aten.is_same_size.default}


# ops that read only their argument's metadata (shape, dtype): no stream-order check
_NO_READ = {aten.new_empty, aten.new_empty_strided, aten.new_full, aten.new_zeros, aten.new_ones,
            aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like}


class SimCudaError(RuntimeError):
    """What the simulated device caught: a mixed-device op, an unordered stream read, a bad copy."""


@dataclasses.dataclass
class Copy:
    """One host-device copy: ``direction`` "H2D" or "D2H", bytes, source pinned, non_blocking, stream."""

    direction: str
    nbytes: int
    pinned: bool
    non_blocking: bool
    stream: int
    where: str


def _inner_of(t):
    return t.inner if isinstance(t, SimTensor) else t


class SimTensor(torch.Tensor):
    """(any shape) a tensor that reports ``cuda:0`` and holds ``inner``, a CPU tensor of the same shape."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=CUDA, requires_grad=inner.requires_grad,
            # never 0 elements: dynamo would resize its fake CUDA storage to 0, which a CPU-only torch cannot
            storage_size=max(1, inner.untyped_storage().nbytes() // inner.element_size()))
        r.inner = inner
        return r

    def as_subclass(self, cls):
        """A subclass view the runtime makes (its cache stubs) stays on the simulated device."""
        if cls is torch.Tensor or issubclass(cls, SimTensor):
            return self if cls is torch.Tensor else cls(self.inner)
        return _on_device(cls)(self.inner)

    # storage identity as on a GPU (the runtime keys buffers by their storage's address); a wrapper
    # subclass has no storage of its own
    # (while dynamo compiles it describes the wrapper itself: a shared storage would read as aliasing)
    def untyped_storage(self):
        if torch.compiler.is_compiling():
            return super().untyped_storage()
        return self.inner.untyped_storage()

    def tolist(self):  # a device-to-host read (torch refuses .tolist() on subclasses)
        sim = getattr(_ACTIVE, "sim", None)
        if sim is not None:
            sim.syncs += 1
        return self.inner.tolist()

    def data_ptr(self) -> int:
        if torch.compiler.is_compiling():
            return super().data_ptr()
        return self.inner.data_ptr()

    def __repr__(self, *, tensor_contents=None):
        return f"SimTensor({self.inner!r}, device='cuda:0')"

    # a traceable wrapper subclass: dynamo traces models whose tensors are SimTensors
    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return SimTensor(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


@functools.cache
def _on_device(cls: type) -> type:
    """``cls`` (a tensor subclass of the runtime, e.g. its CacheStub) on the simulated device."""
    def __torch_function__(sub, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "kvpass":
            # the runtime's ops take the plain device tensor (CacheStub's ``plain`` tests the exact type)
            args, kwargs = tree_map(lambda t: SimTensor(t.inner) if isinstance(t, sub) else t, (args, kwargs))
            return func(*args, **kwargs)
        return cls.__torch_function__.__func__(sub, func, types, args, kwargs)

    return type(f"Sim{cls.__name__}", (cls, SimTensor),
                {"__torch_function__": classmethod(__torch_function__)})


def to_sim(t: torch.Tensor) -> torch.Tensor:
    """The simulated-device copy of CPU tensor ``t`` (not counted as a copy)."""
    if isinstance(t, SimTensor):
        return t
    return SimTensor(t.detach().clone() if t.device.type == "cpu" else t.detach().cpu())


def from_sim(t):
    """The CPU tensor under ``t`` (``t`` itself when it is not simulated); maps over tuples and lists."""
    if isinstance(t, (tuple, list)):
        return type(t)(from_sim(x) for x in t)
    return t.inner if isinstance(t, SimTensor) else t


def sim_module(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module``'s parameters and buffers onto the simulated device, in place."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not isinstance(p.data, SimTensor):
                m._parameters[name] = torch.nn.Parameter(to_sim(p.data), requires_grad=False)
        for name, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, SimTensor):
                m._buffers[name] = to_sim(b)
    return module


# ---------------------------------------------------------------------------------------------------
# streams and events
# ---------------------------------------------------------------------------------------------------


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: an id and a clock of what it has waited for."""

    def __init__(self, device=None, priority: int = 0, *, _sim: SimCuda | None = None,
                 _sid: int | None = None):
        self.sim = _sim if _sim is not None else _current()
        self.sid = self.sim._new_stream_id() if _sid is None else _sid
        self.device = CUDA
        self.sim.clock.setdefault(self.sid, {})

    def wait_stream(self, other: _Stream) -> None:
        self.sim._wait(self.sid, other.sid, self.sim.seq)

    def wait_event(self, event: _Event) -> None:
        if event.stream is not None:
            self.sim._wait(self.sid, event.stream, event.seq)

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.sim._wait(0, self.sid, self.sim.seq)

    def query(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.sid == self.sid

    def __hash__(self):
        return hash(self.sid)

    def __repr__(self):
        return f"<simulated cuda stream {self.sid}>"


class _Event:
    """A stand-in for ``torch.cuda.Event``: the stream and the point it was recorded at."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.stream: int | None = None
        self.seq = 0

    def record(self, stream: _Stream | None = None) -> None:
        sim = _current()
        self.stream = (stream or sim.current).sid
        self.seq = sim.seq

    def wait(self, stream: _Stream | None = None) -> None:
        (stream or _current().current).wait_event(self)

    def synchronize(self) -> None:
        if self.stream is not None:
            _current()._wait(0, self.stream, self.seq)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _current() -> SimCuda:
    sim = getattr(_ACTIVE, "sim", None)
    if sim is None:
        raise SimCudaError("kvpass.simcuda: a simulated CUDA call outside `with SimCuda():`")
    return sim


# ---------------------------------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------------------------------


def _frame() -> str:
    """The innermost kvpass frame outside this module, as ``file:line (function)``."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("kvpass") and name != __name__:
            return f"{name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "(no kvpass frame)"


class _Mode(TorchDispatchMode):
    """Routes every aten op (factory calls with ``device="cuda"`` included) through :func:`_dispatch`."""

    def __init__(self, sim: SimCuda):
        super().__init__()
        self.sim = sim

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # dynamo may compile under it (and traces with it off)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class SimCuda:
    """The simulated device's block: ``with SimCuda() as sim: ...``; ``sim.copies``, ``sim.errors``,
    ``sim.mixed`` (ops that mixed devices) and :meth:`h2d_bytes` afterwards."""

    def __init__(self, raise_errors: bool = True):
        self.raise_errors = raise_errors
        self.copies: list[Copy] = []
        self.errors: list[str] = []
        self.mixed = 0
        self.syncs = 0  # device-to-host reads of a value (.item(), .tolist(), a bool test)
        self.launches = 0  # Triton kernel launches (interpreted)
        self.seq = 0  # a clock: one tick per op on the device
        self.clock: dict[int, dict[int, int]] = {0: {}}  # stream -> {other stream: seq it has waited for}
        self.writer: dict[int, tuple[int, int, str]] = {}  # storage -> (stream, seq, op) of its last write
        self.pinned: set[int] = set()  # data_ptrs of host storages allocated pinned
        self._next_sid = 1
        self.default = None
        self.current = None
        self._stack: contextlib.ExitStack | None = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _new_stream_id(self) -> int:
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        return sid

    def _wait(self, waiter: int, other: int, seq: int) -> None:
        c = self.clock.setdefault(waiter, {})
        c[other] = max(c.get(other, 0), seq)

    def fail(self, msg: str) -> None:
        self.errors.append(msg)
        if self.raise_errors:
            raise SimCudaError(msg)

    def h2d_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.direction == "H2D")

    def mark(self) -> tuple[int, int]:
        """A point in the copy log, for :meth:`since`."""
        return len(self.copies), self.syncs

    def since(self, mark: tuple[int, int]) -> dict[str, int]:
        new = self.copies[mark[0]:]
        return {"h2d_bytes": sum(c.nbytes for c in new if c.direction == "H2D"),
                "d2h_bytes": sum(c.nbytes for c in new if c.direction == "D2H"),
                "copies": len(new), "syncs": self.syncs - mark[1]}

    # -- block -----------------------------------------------------------------------------------
    def __enter__(self) -> SimCuda:
        if getattr(_ACTIVE, "sim", None) is not None:
            raise SimCudaError("kvpass.simcuda: SimCuda blocks do not nest")
        _ensure_guard()
        _ACTIVE.sim = self
        self.default = _Stream(_sim=self, _sid=0)
        self.current = self.default
        st = self._stack = contextlib.ExitStack()
        try:
            cuda = torch.cuda
            st.enter_context(mock.patch.object(cuda, "is_available", lambda: True))
            st.enter_context(mock.patch.object(cuda, "device_count", lambda: 1))
            # torch.tensor(..., device="cuda") initialises CUDA before the copy the mode then sees
            st.enter_context(mock.patch.object(cuda, "_lazy_init", lambda: None))
            st.enter_context(mock.patch.object(cuda, "current_device", lambda: 0))
            st.enter_context(mock.patch.object(cuda, "Stream", _Stream))
            st.enter_context(mock.patch.object(cuda, "Event", _Event))
            st.enter_context(mock.patch.object(cuda, "current_stream", lambda device=None: self.current))
            st.enter_context(mock.patch.object(cuda, "default_stream", lambda device=None: self.default))
            st.enter_context(mock.patch.object(cuda, "stream", self._stream_ctx))
            st.enter_context(mock.patch.object(cuda, "synchronize", self._synchronize))
            st.enter_context(mock.patch.object(cuda, "get_device_properties", _properties))
            # dynamo saves and restores the CUDA RNG state around tracing when CUDA is available
            st.enter_context(mock.patch.object(cuda, "get_rng_state",
                                               lambda device="cuda": torch.zeros(16, dtype=torch.uint8)))
            st.enter_context(mock.patch.object(cuda, "set_rng_state", lambda state, device="cuda": None))
            st.enter_context(mock.patch.object(torch, "Generator", _SimGenerator))
            for name in ("tensor", "as_tensor"):  # they bypass dispatch modes: made on the host, then copied
                st.enter_context(mock.patch.object(torch, name, _host_then_copy(getattr(torch, name))))
            _patch_triton(st, self)
            st.enter_context(_sdpa_as_cuda())
            st.enter_context(_Mode(self))
        except BaseException:
            st.close()
            _ACTIVE.sim = None
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._stack.close()
        finally:
            _ACTIVE.sim = None

    @contextlib.contextmanager
    def _stream_ctx(self, stream):
        prev = self.current
        self.current = stream if stream is not None else prev
        try:
            yield stream
        finally:
            self.current = prev

    def _synchronize(self, device=None) -> None:
        for sid in list(self.clock):
            self._wait(0, sid, self.seq)

    # -- stream order ----------------------------------------------------------------------------
    def _check_reads(self, func, tensors: list[torch.Tensor]) -> None:
        sid = self.current.sid
        for t in tensors:
            w = self.writer.get(_storage(t))
            if w is None or w[0] == sid:
                continue
            if self.clock.get(sid, {}).get(w[0], 0) < w[1]:
                self.fail(f"kvpass.simcuda: {func} on stream {sid} reads a buffer that stream {w[0]} wrote "
                          f"({w[2]}) with no wait_event/wait_stream in between, at {_frame()}")

    def _note_writes(self, func, tensors: list[torch.Tensor]) -> None:
        self.seq += 1
        for t in tensors:
            self.writer[_storage(t)] = (self.current.sid, self.seq, str(func))


def _storage(t: torch.Tensor) -> int:
    return _inner_of(t).untyped_storage().data_ptr()


class _SimGenerator(torch.Generator):
    """``torch.Generator(device="cuda")``: a CPU generator (the simulated device's random numbers are the
    CPU's, so a simulated run draws what the CPU run draws; a GPU draws other numbers)."""

    def __new__(cls, device=None):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        base = torch._C.Generator  # torch.Generator is this class inside the block
        return base.__new__(cls, device=device) if device is not None else base.__new__(cls)

    def __init__(self, device=None):
        pass


def _host_then_copy(make: Callable) -> Callable:
    @functools.wraps(make)
    def on_host(data, *args, device=None, **kwargs):
        # made on the host and copied, as CUDA does; dynamo traces the same (its fake tensors cannot make a
        # CUDA tensor from data on a CPU-only torch)
        if device is not None and torch.device(device).type == "cuda":
            host = make(data, *args, **kwargs)
            # not host.to(device): under dynamo a constant's copy is run for real, on no CUDA
            return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host)
        return make(data, *args, device=device, **kwargs)

    return on_host


_GUARD_SRC = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
// kvpass.simcuda: the simulated CUDA device keeps its data in CPU memory; its device guard switches nothing
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
}
"""
_guard_lock = threading.Lock()
_guard_loaded: list = []  # the loaded library (a build artifact, once per process)


def _ensure_guard() -> None:
    """Register a no-op device guard for CUDA, which a CPU-only torch lacks: C++ code that guards a
    tensor's device (indexing, ``torch.tensor``) fails on any CUDA tensor without one ("PyTorch is not
    linked with support for cuda devices"). Built once with the C++ compiler into
    ``$KVPASS_CACHE/simcuda`` (default ``~/.cache/kvpass/simcuda``). Where torch has CUDA, nothing."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    with _guard_lock:
        if _guard_loaded or torch.backends.cuda.is_built():
            return
        root = Path(os.environ.get("KVPASS_CACHE") or Path.home() / ".cache" / "kvpass") / "simcuda"
        tdir = Path(torch.__file__).parent
        key = hashlib.sha256((_GUARD_SRC + torch.__version__ + str(tdir)).encode()).hexdigest()[:16]
        lib = root / f"guard-{key}.so"
        if not lib.exists():
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                src = Path(tmp) / "guard.cpp"
                src.write_text(_GUARD_SRC)
                out = Path(tmp) / "guard.so"
                cmd = [os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O1", "-std=c++17",
                       f"-I{tdir / 'include'}", str(src), "-o", str(out), f"-L{tdir / 'lib'}", "-lc10",
                       f"-Wl,-rpath,{tdir / 'lib'}"]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SimCudaError(f"kvpass.simcuda: building the CUDA device guard failed "
                                       f"({' '.join(cmd)}): {r.stderr.strip()[:2000]}")
                os.replace(out, lib)
        _guard_loaded.append(ctypes.CDLL(str(lib)))


def _properties(device=None):
    return _Props()


@dataclasses.dataclass
class _Props:
    name: str = "simulated CUDA device (CPU memory)"
    multi_processor_count: int = 8
    total_memory: int = 1 << 34
    major: int = 8
    minor: int = 0


def _patch_triton(stack: contextlib.ExitStack, sim: SimCuda) -> None:
    """Give Triton's interpreter the CPU tensors under SimTensors (it copies each argument's storage
    to the host with ``.cpu()`` and back with ``copy_``: on a wrapper subclass both would fail)."""
    try:
        from triton.runtime import interpreter
    except Exception:  # no Triton: the kernels' own checks say so
        return
    orig = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        sim.launches += 1
        un = functools.partial(tree_map, _inner_of)
        return orig(self, *un(args), **un(kwargs))

    stack.enter_context(mock.patch.object(interpreter.GridExecutor, "__call__", call))


# ---------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _under_fake_mode() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def _device_kw(kwargs) -> bool:
    d = kwargs.get("device")
    return d is not None and torch.device(d).type == "cuda"


def _sdpa(func, args, kwargs):
    """The CUDA SDPA kernels (flash / efficient / cudnn) on CPU data: the math and placeholder extras."""
    names = [a.name for a in func._schema.arguments]
    a = dict(zip(names, args), **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=a.get("attn_bias", a.get("attn_mask")), dropout_p=0.0,
        is_causal=bool(a.get("is_causal", False)), scale=a.get("scale"),
        enable_gqa=q.shape[-3] != k.shape[-3])
    extras = []
    for r in func._schema.returns[1:]:
        t = str(r.type)
        if t == "Tensor":
            extras.append(torch.empty(0))
        elif "Sym" in t or t == "int":
            extras.append(0)
        else:
            extras.append(None)
    return (out, *extras)


_SDPA_CUDA = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention"}


def _dispatch(func, args, kwargs):
    sim = getattr(_ACTIVE, "sim", None)
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if any(_is_fake(_inner_of(t)) for t in tensors) or _under_fake_mode():
        return _trace(func, args, kwargs)  # dynamo's tracing: metadata only
    if sim is None:
        raise SimCudaError(f"kvpass.simcuda: {func} on a simulated CUDA tensor outside `with SimCuda():`")

    if func is torch.ops.prim.device.default:
        return CUDA
    if func.namespace == "kvpass":
        # the op's Python implementation sees the device tensors and takes its CUDA path
        from kvpass.lowering.ops import IMPLS

        return IMPLS[f"kvpass::{func._opname}"](*args, **kwargs)

    on_dev = [t for t in tensors if isinstance(t, SimTensor)]
    host = [t for t in tensors
            if not isinstance(t, SimTensor) and not (t.dim() == 0 and t.device.type == "cpu")]
    factory_dev = _device_kw(kwargs)
    if on_dev and host and func not in _COPIES and func not in _META and func.overloadpacket is not aten.to:
        sim.mixed += 1
        args_s = ", ".join(f"{'cuda:0' if isinstance(t, SimTensor) else t.device} {tuple(t.shape)}"
                           for t in tensors)
        sim.fail(f"kvpass.simcuda: {func} mixes devices ({args_s}) at {_frame()}")

    if func in _COPIES:
        return _copy(sim, func, args, kwargs)
    if func.overloadpacket is aten.to:  # not decomposed under the Python dispatcher
        return _to(sim, func, args, kwargs)
    if func is aten.is_pinned.default:
        t = args[0]
        return not isinstance(t, SimTensor) and _storage(t) in sim.pinned
    if func in (aten._pin_memory.default, aten.pin_memory.default):
        out = args[0].clone()
        sim.pinned.add(_storage(out))
        return out
    if func is aten._local_scalar_dense.default and on_dev:
        sim.syncs += 1
        return func(_inner_of(args[0]))

    pin = bool(kwargs.get("pin_memory"))
    if pin:
        kwargs = {**kwargs, "pin_memory": False}
    if not on_dev and not factory_dev:
        out = func(*args, **kwargs)
        if pin:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    sim.pinned.add(_storage(t))
        return out

    # a device op: stream order (a view reads no data), then the op on the CPU data
    view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    if not view and func.overloadpacket not in _NO_READ:
        sim._check_reads(func, on_dev)
    un_args, un_kwargs = tree_map(_inner_of, args), tree_map(_inner_of, kwargs)
    if factory_dev:
        un_kwargs["device"] = torch.device("cpu")
    if func._opname in _SDPA_CUDA:
        out = _sdpa(func, un_args, un_kwargs)
    else:
        out = func(*un_args, **un_kwargs)
    # in-place ops return their argument itself; their written arguments get this stream's clock
    written = []
    ret = None
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(args) \
                and isinstance(args[i], SimTensor):
            written.append(args[i])
            if func._schema.returns and func._schema.returns[0].alias_info is not None and ret is None:
                ret = args[i]
    wrapped = tree_map(lambda x: SimTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, SimTensor)
                       and x.device.type == "cpu" else x, out)
    if ret is not None and len(func._schema.returns) == 1:
        i = ret.inner
        # an in-place op that changed the metadata (set_, resize_): a fresh wrapper of the new view
        same = (i.shape, i.stride(), i.storage_offset()) == (ret.shape, ret.stride(), ret.storage_offset())
        wrapped = ret if same else SimTensor(i)
    news = [t for t in tree_flatten(wrapped)[0] if isinstance(t, SimTensor)]
    if not func._schema.is_mutable:
        written = [t for t in news if not _is_view_of(t, on_dev)]
    if written:
        sim._note_writes(func, written)
    return wrapped


def _is_view_of(t, ins) -> bool:
    s = _storage(t)
    return any(_storage(x) == s for x in ins)


def _copy(sim: SimCuda, func, args, kwargs):
    """``_to_copy`` / ``copy_`` across or within devices, counted."""
    if func is aten._to_copy.default:
        src = args[0]
        dev = kwargs.get("device")
        to_dev = torch.device(dev).type == "cuda" if dev is not None else isinstance(src, SimTensor)
        nb = bool(kwargs.get("non_blocking", False))
        kw = {k: v for k, v in kwargs.items() if k != "device"}
        if kw.get("pin_memory"):
            kw["pin_memory"] = False
        if isinstance(src, SimTensor):
            sim._check_reads(func, [src])
        out = func(_inner_of(src), **kw, device=torch.device("cpu"))
        if isinstance(src, SimTensor) != to_dev:
            _count(sim, "H2D" if to_dev else "D2H", src, out, nb)
        if to_dev:
            out = SimTensor(out)
            sim._note_writes(func, [out])
        return out
    dst, src = args[0], args[1]
    nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if isinstance(src, SimTensor):
        sim._check_reads(func, [src])
    if isinstance(dst, SimTensor):
        sim._check_reads(func, [dst])
    _inner_of(dst).copy_(_inner_of(src))
    if isinstance(dst, SimTensor) != isinstance(src, SimTensor):
        _count(sim, "H2D" if isinstance(dst, SimTensor) else "D2H", src, dst, nb)
    if isinstance(dst, SimTensor):
        sim._note_writes(func, [dst])
    return dst


def _to(sim: SimCuda, func, args, kwargs):
    """``aten.to.*`` as ``_to_copy`` (or the tensor itself, where nothing changes)."""
    a = dict(zip([x.name for x in func._schema.arguments], args), **kwargs)
    src = a["self"]
    device, dtype = a.get("device"), a.get("dtype")
    if "other" in a:
        device, dtype = a["other"].device, a["other"].dtype
    to_dev = isinstance(src, SimTensor) if device is None else torch.device(device).type == "cuda"
    dtype = src.dtype if dtype is None else dtype
    if to_dev == isinstance(src, SimTensor) and dtype == src.dtype and not a.get("copy") \
            and a.get("memory_format") in (None, torch.preserve_format):
        return src
    kw = {"dtype": dtype, "device": CUDA if to_dev else torch.device("cpu"),
          "non_blocking": bool(a.get("non_blocking", False))}
    if a.get("memory_format") is not None:
        kw["memory_format"] = a["memory_format"]
    return _copy(sim, aten._to_copy.default, (src,), kw)


def _count(sim: SimCuda, direction: str, src, out, non_blocking: bool) -> None:
    host = src if direction == "H2D" else out
    pinned = _storage(host) in sim.pinned
    nbytes = out.numel() * out.element_size()
    where = _frame()
    sim.copies.append(Copy(direction, nbytes, pinned, non_blocking, sim.current.sid, where))
    if direction == "D2H" and not non_blocking:
        sim.syncs += 1
    if non_blocking and direction == "H2D" and not pinned:
        sim.fail(f"kvpass.simcuda: a non_blocking copy to the device from unpinned host memory "
                 f"({nbytes} bytes, {tuple(out.shape)}) at {where}: on a GPU it is synchronous (pin the "
                 "source: pin_memory() or torch.empty(..., pin_memory=True))")


def _host_fake(t):
    """A SimTensor's fake CPU tensor; a plain fake CUDA tensor (made by a factory while dynamo traces) as
    an alias on the CPU, so that the op sees one device."""
    if isinstance(t, SimTensor):
        return t.inner
    if _is_fake(t) and t.device.type == "cuda":
        with t.fake_mode:
            a = aten.alias.default(t)
        a.fake_device = torch.device("cpu")
        return a
    return t


def _trace(func, args, kwargs):
    """An op under dynamo's or AOTAutograd's fake tensors: run it on the fake CPU tensors underneath."""
    if func is torch.ops.prim.device.default and isinstance(args[0], SimTensor):
        return CUDA
    if not any(isinstance(t, SimTensor) for t in tree_flatten((args, kwargs))[0]):
        return func(*args, **kwargs)  # plain fakes (CUDA ones included): the fake mode's business
    if func.namespace == "kvpass":
        return func(*tree_map(_inner_of, args), **tree_map(_inner_of, kwargs))
    un_args, un_kwargs = tree_map(_host_fake, args), tree_map(_host_fake, kwargs)
    dev = _device_kw(kwargs)
    if dev:
        un_kwargs["device"] = torch.device("cpu")
    if un_kwargs.get("pin_memory"):
        un_kwargs["pin_memory"] = False
    if not dev and kwargs.get("device") is not None:
        return func(*un_args, **un_kwargs)  # to the host
    out = func(*un_args, **un_kwargs)
    return tree_map(lambda x: SimTensor(x) if type(x) is torch.Tensor or _is_fake(x) else x, out)


# ---------------------------------------------------------------------------------------------------
# compiling: the backend's passes, the post-grad graph run by FX
# ---------------------------------------------------------------------------------------------------


def _fake_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> list:
    """Plain fake CUDA tensors in dynamo's fake mode (its symbolic shapes) for each SimTensor input."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    fm = ctx.fake_mode if ctx is not None else None
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for n, e in zip(phs, example_inputs):
        ev = n.meta.get("example_value")
        if isinstance(e, SimTensor) and ev is not None and fm is not None:
            with fm:
                out.append(torch.empty_strided(ev.shape, ev.stride(), dtype=ev.dtype, device=CUDA))
        else:
            out.append(e)
    return out


def _fx_inner(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """``inner_compile`` for Inductor's compile_fx: the post-grad passes (kvpass's included), then the
    graph itself as the callable (run by FX, op by op, on the simulated device)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V

    fake_mode = detect_fake_mode(example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", True))
    gm.recompile()

    def run(args):
        a = list(args)
        args.clear()
        # compiled code runs with the ambient dispatch modes off: the device's mode again, for factories
        with _Mode(_current()):
            return gm(*a)

    run._boxed_call = True
    run.graph_module = gm
    return run


def sdp_choice(q, k, v, attn_mask, dropout_p: float, enable_gqa: bool) -> str:
    """The SDPA kernel a CUDA GPU (sm90) picks, as modelled here (``_fused_sdp_choice``'s CUDA rules, which
    a CPU-only torch lacks: its fake CUDA tensors decompose SDPA into math): "flash" for fp16/bf16 without
    a mask, "efficient" for fp16/bf16/fp32 (masks allowed), else "math"."""
    d = q.shape[-1]
    if dropout_p == 0.0 and attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and d <= 256 \
            and d % 8 == 0 and d == v.shape[-1]:
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and d % 8 == 0 and v.shape[-1] % 8 == 0:
        return "efficient"
    return "math"


def _sdpa_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """``aten.scaled_dot_product_attention`` decomposed as CUDA does it (see :func:`sdp_choice`)."""
    choice = sdp_choice(query, key, value, attn_mask, dropout_p, enable_gqa)
    if choice == "flash":
        return aten._scaled_dot_product_flash_attention.default(query, key, value, dropout_p, is_causal,
                                                                False, scale=scale)[0]
    if choice == "efficient":
        if enable_gqa and query.shape[-3] != key.shape[-3]:
            # assumed: the efficient kernel takes one KV head per query head (the flash kernel takes groups)
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as torch's convert_boolean_attn_mask
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        return aten._scaled_dot_product_efficient_attention.default(query, key, value, attn_mask, False,
                                                                    dropout_p, is_causal, scale=scale)[0]
    return NotImplemented


@contextlib.contextmanager
def _sdpa_as_cuda():
    """While the block runs, tracing (AOTAutograd runs the Python dispatcher) decomposes SDPA on CUDA
    tensors with :func:`_sdpa_cuda`; other devices keep torch's own decomposition."""
    from torch._C import DispatchKey

    op = aten.scaled_dot_product_attention.default
    dk = DispatchKey.CompositeImplicitAutograd
    if dk in op.py_kernels:
        raise SimCudaError(f"kvpass.simcuda: {op} already has a Python decomposition")

    def decomp(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if query.device.type == "cuda":
            out = _sdpa_cuda(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            if out is not NotImplemented:
                return out
        return op._op_dk(dk, query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                         enable_gqa=enable_gqa)

    op.py_impl(dk)(decomp)
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.pop(dk, None)
        op._dispatch_cache.clear()


def sim_compile(compile_fx: Callable) -> Callable:
    """``compile_fx`` wrapped for the simulated device: CUDA fake inputs, FX execution, and Inductor's
    joint-graph patterns initialised for the CPU (their CUDA initialisation needs a driver)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes import joint_graph

    @functools.wraps(compile_fx)
    def compile(gm, example_inputs, **kw):
        kw.pop("inner_compile", None)
        orig = joint_graph.lazy_init
        # joint-graph constant folding runs real ops on CUDA tensors while compiling, and shape padding
        # benchmarks matmuls on the device: both off
        cpu_init = lambda input_device=None: orig(torch.device("cpu"))  # noqa: E731
        with mock.patch.object(joint_graph, "lazy_init", cpu_init), \
                inductor_config.patch(joint_graph_constant_folding=False, shape_padding=False):
            return compile_fx(gm, example_inputs, inner_compile=_fx_inner, **kw)

    return compile


def sim_backend(backend: Callable, simulated: bool = True) -> Callable:
    """A dynamo backend that runs ``backend`` (a :class:`kvpass.KVPassBackend` or another backend built on
    Inductor's ``compile_fx``) with ``compile_fx`` stopping after the post-grad passes and the graph run by
    FX. ``simulated``: the graphs see fake CUDA inputs and run on the simulated device (inside
    ``SimCuda``); False: the same on the CPU (the check's reference, without Inductor's C++ codegen)."""
    import torch._inductor.compile_fx as cfx

    def compile_sim(gm, example_inputs, **kw):
        if not simulated:
            with mock.patch.object(cfx, "compile_fx", _cpu_compile(cfx.compile_fx)):
                return backend(gm, example_inputs, **kw)
        fakes = _fake_inputs(gm, example_inputs)
        with mock.patch.object(cfx, "compile_fx", sim_compile(cfx.compile_fx)):
            return backend(gm, fakes, **kw)

    compile_sim.__name__ = "kvpass_simcuda" if simulated else "kvpass_fx"
    return compile_sim


def _cpu_compile(compile_fx: Callable) -> Callable:
    @functools.wraps(compile_fx)
    def compile(gm, example_inputs, **kw):
        kw.pop("inner_compile", None)
        return compile_fx(gm, example_inputs, inner_compile=_fx_inner_cpu, **kw)

    return compile


def _fx_inner_cpu(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", True))
    gm.recompile()

    def run(args):
        a = list(args)
        args.clear()
        return gm(*a)

    run._boxed_call = True
    run.graph_module = gm
    return run
