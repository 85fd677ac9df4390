"""Where tensors live: an audit that fails when a notebook leaves work on the host.

On a CPU-only machine every tensor is on the CPU, so a notebook that forgets ``.to(run.device)``
runs fine here and then, on a GPU, either trains its model on the CPU (a module never moved) or
stops with "Expected all tensors to be on the same device" (a tensor built on the host and fed to
a moved model). This audit makes those mistakes visible without a GPU.

With ``WORKBENCH_DEVICE_AUDIT=1`` a CPU run's ``run.device`` is the sentinel ``cpu:0``: the same
CPU, but a device that code can only reach by being handed ``run.device`` (``"cpu:0"`` is written
nowhere in the workbench). A :class:`torch.overrides.TorchFunctionMode` then marks every tensor
that reached the run's device and follows the marks through every torch call:

* ``.to(run.device)`` / ``Module.to(run.device)`` marks; ``x.device`` answers ``cpu:0`` for a
  marked tensor and ``cpu`` for another, so ``.to(x.device)`` and factories given
  ``device=x.device`` follow ``x`` exactly; ``.cpu()``, ``.to("cpu")`` and factories without a
  device leave the result on the host, unmarked.
* any other call's results are marked when one of its tensor inputs is.

Three things are violations, each recorded with the line of workbench or notebook code that did
it: ``host-parameter``, a module computing with a parameter that never reached the run's device
(a model left behind, an adapter built after the model was moved); ``mixed``, a call given
tensors of both kinds with more than one element (a device-mismatch error on a GPU); ``numpy``,
a device tensor read by numpy without ``.cpu()`` (an error on a GPU). Work that is
meant to run on the host (float64 linear algebra, scikit-learn features) goes inside
``with placement.host():``, which the audit skips. Inside ``torch.func`` transforms (vmap, grad)
tensors are wrappers the marks do not reach: those calls are not audited, what goes in and comes
out is. Slower than a plain run (a Python call per
torch call): tests use it on small sizes.
"""
from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ENV = "WORKBENCH_DEVICE_AUDIT"
SENTINEL = torch.device("cpu", 0)
_MARK = "_wb_on_device"
# calls whose tensor arguments may legitimately live on the host next to device tensors
_HOST_OK = {"__getitem__", "__setitem__", "copy_", "to", "cpu", "__get__", "__set__", "item",
            "tolist", "numpy", "__format__", "__repr__", "__len__", "__iter__", "__bool__",
            "__index__", "__int__", "__float__", "is_floating_point", "dim", "size", "numel",
            "_has_compatible_shallow_copy_type", "data_ptr", "__reduce_ex__", "__deepcopy__",
            "detach", "requires_grad_", "clone", "__contains__", "equal", "allclose"}
_COMPUTE = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "embedding",
            "scaled_dot_product_attention", "einsum", "__matmul__", "layer_norm", "rms_norm",
            "group_norm", "lstm", "gru", "rnn_tanh", "rnn_relu"}

_DEVICE_ATTR = torch.Tensor.device          # Tensor.device's descriptor (its __get__ is audited)
_HOST = torch.device("cpu")
_active: "Audit | None" = None


def requested() -> bool:
    """Whether this process runs under the audit (``WORKBENCH_DEVICE_AUDIT=1``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _mark(t, on: bool = True) -> None:
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, _MARK, on)
        except (AttributeError, RuntimeError):
            pass


def _functorch_wrapped(t) -> bool:
    """Whether ``t`` is one of ``torch.func``'s wrappers (vmap's batched, grad's tracking
    tensors), which carry no attributes of the tensor they wrap."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _where() -> str:
    """The innermost frame of workbench or notebook code (not torch, transformers, this file)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if f.endswith("/workbench/placement.py"):
            continue
        if "/workbench/" in f or "ipykernel" in f or "<ipython-input" in f or "/tests/" in f:
            short = f.split("/workbench/", 1)[-1] if "/workbench/" in f else \
                f.rsplit("/", 1)[-1] if "/tests/" in f else "notebook cell"
            return f"{short}:{frame.lineno} ({frame.name}): {(frame.line or '').strip()[:80]}"
    return "?"


def _target(device) -> bool | None:
    """True: the run's device (the sentinel ``cpu:0``, which is also what ``x.device`` says of a
    marked tensor, or a GPU); False: the host (``"cpu"``, ``torch.device("cpu")``, what
    ``x.device`` says of an unmarked tensor); None: no device given."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type != "cpu" or device.index is not None
    if isinstance(device, str):
        return device != "cpu"
    if isinstance(device, int):          # a CUDA ordinal
        return True
    return None


def _to_device(args, kwargs):
    """The device argument of a ``Tensor.to``/``Module.to`` call (None when only a dtype)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:] if args and isinstance(args[0], (torch.Tensor, torch.nn.Module)) else args:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return a
    return None


class Audit(TorchFunctionMode):
    """The tensor-following mode; :func:`start` installs one for the whole process."""

    def __init__(self):
        super().__init__()
        self.violations: dict[tuple[str, str], dict] = {}
        self.host_depth = 0
        self.paused = 0

    def flag(self, kind: str, what: str) -> None:
        where = _where()
        v = self.violations.setdefault((kind, where), {"kind": kind, "where": where,
                                                       "call": what, "count": 0})
        v["count"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.host_depth:
            return out
        name = getattr(func, "__name__", str(func))
        if name == "__get__" and getattr(func, "__self__", None) is _DEVICE_ATTR:
            if out.type != "cpu":              # meta (transformers' loading), a real GPU: as is
                return out
            return SENTINEL if on_device(args[0]) else _HOST     # x.device tells where x is
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(_functorch_wrapped(t) for t in ins):
            return out        # inside vmap/grad the marks do not reach: the boundary is audited
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in ("cpu", "to"):
            like = [a for a in args[1:] if isinstance(a, torch.Tensor)]   # .to(other_tensor)
            dest = False if name == "cpu" else _target(_to_device(args, kwargs))
            on = on_device(like[0]) if like else \
                bool(ins and on_device(ins[0])) if dest is None else dest
            if isinstance(out, torch.Tensor) and ins and out is ins[0] and on != on_device(out):
                out = out.view_as(out)         # the sentinel moved nothing: mark an alias, as a
            _mark(out, on)                     # GPU's copy would be, never the input itself
            return out
        if name == "numpy" and ins and on_device(ins[0]):
            self.flag("numpy", "numpy() of a device tensor (a GPU needs .cpu() first)")
            return out
        marked = [t for t in ins if on_device(t)]
        if name not in _HOST_OK:
            host = [t for t in ins if not on_device(t) and t.numel() > 1]
            params = [t for t in host if isinstance(t, torch.nn.Parameter)]
            if params and name in _COMPUTE:
                self.flag("host-parameter", f"{name} with a parameter of shape "
                                            f"{tuple(params[0].shape)} on the host")
            elif marked and host:
                self.flag("mixed", f"{name} mixes device tensors with a host tensor of shape "
                                   f"{tuple(host[0].shape)}")
        if kwargs.get("device") is not None:       # a factory, or as_tensor(x, device=...)
            on = bool(_target(kwargs["device"]))
        else:
            on = bool(marked)
        for t in outs:
            if on or not any(t is i for i in ins):
                _mark(t, on)
        return out


def _module_to(original):
    def to(self, *args, **kwargs):
        audit = _active
        if audit is None:
            return original(self, *args, **kwargs)
        dest = _target(_to_device(args, kwargs))
        before = {id(t): on_device(t) for t in _tensors(self)}
        audit.paused += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            audit.paused -= 1
        for t in _tensors(self):
            _mark(t, before.get(id(t), False) if dest is None else dest)
        return result
    to._wb_original = original
    return to


def _module_cpu(original):
    def cpu(self):
        result = original(self)
        for t in _tensors(self):
            _mark(t, False)
        return result
    cpu._wb_original = original
    return cpu


def _parameter_new(original):
    def new(cls, data=None, requires_grad=True):
        p = original(cls, data, requires_grad)
        if on_device(data):                      # nn.Parameter(w.detach().clone()) stays put
            _mark(p)
        return p
    new._wb_original = original
    return new


def _deepcopy(original):
    def deepcopy(self, memo):
        new = original(self, memo)
        if on_device(self):                      # copy.deepcopy(model) stays where model is
            _mark(new)
        return new
    deepcopy._wb_original = original
    return deepcopy


_DEEPCOPY = (torch.Tensor, torch.nn.Parameter)


def _tensors(module):
    return [*module.parameters(), *module.buffers()]


def start() -> Audit:
    """Install the audit for this process (idempotent); return it."""
    global _active
    if _active is None:
        _active = Audit()
        _active.__enter__()
        torch.nn.Module.to = _module_to(torch.nn.Module.to)
        torch.nn.Module.cpu = _module_cpu(torch.nn.Module.cpu)
        torch.nn.Parameter.__new__ = staticmethod(_parameter_new(torch.nn.Parameter.__new__))
        for cls in _DEEPCOPY:
            cls.__deepcopy__ = _deepcopy(cls.__dict__["__deepcopy__"])
    return _active


def stop() -> list[dict]:
    """Remove the audit; return its violations."""
    global _active
    if _active is None:
        return []
    found = report()
    _active.__exit__(None, None, None)
    torch.nn.Module.to = torch.nn.Module.to._wb_original
    torch.nn.Module.cpu = torch.nn.Module.cpu._wb_original
    torch.nn.Parameter.__new__ = staticmethod(torch.nn.Parameter.__new__._wb_original)
    for cls in _DEEPCOPY:
        cls.__deepcopy__ = cls.__dict__["__deepcopy__"]._wb_original
    _active = None
    return found


def report() -> list[dict]:
    """The violations so far, one per (kind, code line), most frequent first."""
    if _active is None:
        return []
    return sorted(_active.violations.values(), key=lambda v: -v["count"])


def on_host(fn):
    """Decorator: ``fn`` is host work by design (see :func:`host`)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with host():
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def host():
    """Work meant for the host (float64 algebra, features for scikit-learn): not audited."""
    audit = _active
    if audit is not None:
        audit.host_depth += 1
    try:
        yield
    finally:
        if audit is not None:
            audit.host_depth -= 1
