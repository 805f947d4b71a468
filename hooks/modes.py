"""The three ways capture sees a model: module hooks, a TorchFunctionMode (``api``) and a
TorchDispatchMode (``aten``). Each hands what it sees to the :class:`~hooks.recorder.Recorder`."""

from __future__ import annotations

from types import CodeType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hooks.distributed import landed
from hooks.opcall import NotReplayable, draws_random_numbers, encode_call, layouts_of, op_target
from hooks.recorder import Recorder
from hooks.tensors import NO_NUMBER_OPS, fast_leaves

_NO_NUMBER_API = frozenset(op.removeprefix("aten.") for op in NO_NUMBER_OPS) | {
    "__getitem__", "__get__", "size", "dim", "numel", "stride", "data_ptr", "storage_offset", "is_contiguous",
    "element_size", "tolist", "__len__", "__iter__", "__format__", "__repr__", "__bool__", "__index__", "__hash__",
}


_NO_KWARGS: dict[str, Any] = {}  # never written to: an ATen call's kwargs are only read

#: what every call of one op overload shares, learnt at its first call, for every capture of the
#: process; by ``skip_no_number_ops``, then by ``id(overload)`` (``OpOverload`` hashes in Python;
#: the entry holds the overload, so its id is never reused): (name, skip, mutates, the callable to
#: run, whether outputs land asynchronously (c10d), the overload)
_OP_FACTS: dict[bool, dict[int, tuple[str, bool, bool, Any, bool, Any]]] = {True: {}, False: {}}

#: torch.distributed's op namespaces: treated as writes (see AtenMode._mutable)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def _quiet() -> Any:
    """While the recorder itself works in a module or gradient hook: no Python dispatch, so the
    ``aten`` level's own mode does not see (and pay its Python cost for) each op the recorder runs; it
    records nothing while ``busy`` anyway, and the recorder runs no in-place op."""
    return torch._C._DisableTorchDispatch()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _untraced(code: CodeType) -> bool:
    """Have TorchDynamo skip ``code`` and every frame it calls, as ``torch._disable_dynamo`` (which
    ``TorchDispatchMode`` wraps each ``__torch_dispatch__`` in) does with two more Python frames and
    three ``set_eval_frame`` calls per dispatch. Without it, a ``torch.compile``'d
    function called inside a capture would compile the handler itself. False where this torch has
    no such switch (then the wrapper stays)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False
    return True


class AtenMode(TorchDispatchMode):
    """Records every ATen op that moves numbers, tagged with the innermost module path."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Asked once, when the class is made: wrap ``__torch_dispatch__`` only if it cannot be marked."""
        return not _untraced(cls.__dict__["__torch_dispatch__"].__code__)

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._info = _OP_FACTS[recorder.opts.skip_no_number_ops]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = _NO_KWARGS
        rec = self.recorder
        info = self._info.get(id(func))
        if info is None:
            try:
                info = self._learn(func)
            except Exception as e:  # noqa: BLE001 - capture must never break the user's run
                rec.diagnose(None, e)
                rec.settle_background()  # it may write in place
                return func(*args, **kwargs)
        name, skip, mutates, call, lands, _ = info
        if mutates:
            rec.stats.epoch += 1  # earlier statistics no longer describe memory this op writes
            rec.settle_background()
        if rec.busy or not rec.active:
            return call(*args, **kwargs)
        if skip:  # views, metadata, allocation: counted, nothing else (~40% of a decoder's calls)
            rec.skipped[name] += 1
            return call(*args, **kwargs)
        try:
            plan = self._plan(func, name, mutates, args, kwargs)
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            rec.diagnose(None, e)
            plan = None
        if mutates and rec.opts.inputs:
            rec.settle_background()  # the inputs just stored for replay are on disk before the op writes into them
        out = call(*args, **kwargs)
        if plan is not None:
            rec.record("aten", *plan[:4], landed(out) if lands else out, *plan[4:])
        return out

    def before_unseen_ops(self) -> None:
        """Ops this mode will not see are about to run (a compiled block, see ``hooks.compiled``): the
        recorder's background readers of the model's memory finish first, as before an in-place op."""
        self.recorder.settle_background()

    def _learn(self, func: Any) -> tuple[str, bool, bool, Any, bool, Any]:
        """What every call of this op overload shares: its name, whether it is skipped, whether it
        writes in place; and ``func._op``, the C++ callable ``OpOverload.__call__`` forwards to."""
        name, skip = self._classify(func)
        call = func._op if type(func) is torch._ops.OpOverload else func
        info = self._info[id(func)] = (name, skip, self._mutable(func), call, func.namespace == "c10d", func)
        return info

    def _plan(self, func: Any, name: str, mutates: bool, args: tuple, kwargs: dict) -> tuple[Any, ...] | None:
        """What to record for this call (module, op, key, ordinal, inputs …), or None to let it pass."""
        rec = self.recorder
        if torch._C._current_graph_task_id() != -1:  # in_backward(), inlined: this runs for every op
            rec.skipped[f"(backward) {name}"] += 1
            return None
        stack = rec.stack
        module = stack[-1] if stack else ""
        key, ordinal = rec.next_key(module, name)
        rec.ops_seen += 1
        if rec.filtered and not rec.wants(module, name):
            return None
        in_tensors = _aten_tensors(args, kwargs)
        input_names = self._inputs(func, key, args, kwargs) if rec.opts.inputs else None
        return module, name, key, ordinal, in_tensors, input_names, mutates

    def _mutable(self, func: Any) -> bool:
        """Whether the op may write into existing memory. Collectives count too: c10d's in-place ones
        (``allreduce_``, ``broadcast_`` …) declare no mutation in their schemas, and their results
        land asynchronously."""
        return bool(func._schema.is_mutable) or func.namespace in COLLECTIVE_NAMESPACES

    def _classify(self, func: Any) -> tuple[str, bool]:
        name = str(func.overloadpacket)
        skip = self.recorder.opts.skip_no_number_ops and (name in NO_NUMBER_OPS or bool(getattr(func, "is_view", False)))
        if func.namespace in COLLECTIVE_NAMESPACES and func.namespace != "c10d" and not name.endswith("wait_tensor"):
            skip = True  # functional collectives: the result is recorded at its wait_tensor, once it has landed
        return name, skip

    def _inputs(self, func: Any, key: str, args: tuple, kwargs: dict) -> list[str | None] | None:
        """Snapshot the inputs and note the call so replay can run it again."""
        rec = self.recorder
        try:
            call, tensors = encode_call(args, kwargs)
            if draws_random_numbers(func, args, kwargs):
                raise NotReplayable("the op draws random numbers")
            if any(t.is_quantized or t.is_complex() for t in tensors):
                raise NotReplayable("quantized and complex inputs are stored as float values only")
        except NotReplayable as e:
            rec.diagnose(key, f"not replayable: {e}")
            return None
        except Exception as e:  # noqa: BLE001
            rec.diagnose(key, e)
            return None
        names = rec.snapshot_inputs(key, tensors)
        rec.calls[key] = {"target": op_target(func), **call, "grad": torch.is_grad_enabled(),
                          **layouts_of(tensors)}
        return names


def _aten_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an ATen call's arguments, in ``tree_leaves((args, kwargs))`` order.

    ATen schemas nest at most one level (``Tensor[]``, ``Tensor?[]``), so a flat walk suffices;
    anything deeper takes the generic pytree walk."""
    out: list[torch.Tensor] = []
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif type(a) in (list, tuple):
                for t in a:
                    if isinstance(t, torch.Tensor):
                        out.append(t)
                    elif type(t) in (list, tuple, dict):
                        return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            elif isinstance(a, (dict, list, tuple)):
                return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    return out


class ApiMode(TorchFunctionMode):
    """Records each top-level ``torch.*`` / ``Tensor.*`` / ``F.*`` call (not the ops inside it)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._names: dict[Any, tuple[str, bool]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.recorder
        if rec.busy or not rec.active or in_backward():
            return out
        name, skip = self._names.get(func) or self._classify(func)
        if skip:
            rec.skipped[name] += 1
            return out
        leaves = [out] if isinstance(out, torch.Tensor) else tree_leaves(out)
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            return out
        module = rec.module
        key, ordinal = rec.next_key(module, name)
        rec.ops_seen += 1
        if rec.wants(module, name):
            in_tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            rec.busy = True
            try:
                rec.record("api", module, name, key, ordinal, out, in_tensors)
            finally:
                rec.busy = False
        return out

    def _classify(self, func: Any) -> tuple[str, bool]:
        try:
            name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
        except Exception:  # noqa: BLE001
            name = repr(func)
        short = name.rsplit(".", 1)[-1]
        skip = self.recorder.opts.skip_no_number_ops and (short in _NO_NUMBER_API or name.endswith("__get__"))
        self._names[func] = (name, skip)
        return name, skip


class ModuleHooks:
    """Global forward (and, with ``backward=True``, gradient) hooks that keep the module stack
    and record each module's outputs as ``path/forward#N`` (and ``path/backward#N``)."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder) -> None:
        self.rec = recorder
        self.names = {id(m): n for n, m in model.named_modules()}
        self.handles: list[Any] = []
        self.model = model
        self.observer: Any = None  # hooks.observer.ObserverMode: told of each module, drained before each record

    def install(self) -> None:
        mm = torch.nn.modules.module
        self.handles = [mm.register_module_forward_pre_hook(self._pre), mm.register_module_forward_hook(self._post)]
        if self.rec.opts.backward:
            for pname, p in self.model.named_parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._param_hook(pname)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.rec.stack.append(name)
            if self.observer is not None:
                self.observer.sync()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        rec = self.rec
        stack = rec.stack
        while stack:  # pop back to this module, even if an inner forward raised earlier
            if stack.pop() == name:
                break
        if self.observer is not None and self.observer.record_module(name, args, output):
            return  # recorded by the compiled observer (or nothing to record), in order with the ops
        if not rec.active:
            return
        rec.busy = True
        try:
            with _quiet():
                key, ordinal = rec.next_key(name, "forward")
                rec.ops_seen += 1
                if not rec.filtered or rec.wants(name, "forward"):
                    rec.record("module", name, "forward", key, ordinal, output, fast_leaves(args))
                if rec.opts.backward and torch.is_grad_enabled():
                    self._watch_grads(name, output)
        except Exception as e:  # noqa: BLE001
            rec.diagnose(f"{name}/forward", e)
        finally:
            rec.busy = False

    def _watch_grads(self, name: str, output: Any) -> None:
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._grad_hook(name))

    def _grad_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._record_grad(name, "backward", grad)

        return hook

    def _param_hook(self, pname: str) -> Any:
        module, _, leaf = pname.rpartition(".")

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._record_grad(module, f"grad.{leaf}", p.grad)

        return hook

    def _record_grad(self, module: str, op: str, grad: torch.Tensor) -> None:
        rec = self.rec
        if rec.closed or not rec.active:
            return
        rec.busy = True
        try:
            with _quiet():
                key, ordinal = rec.next_key(module, op)
                if rec.wants(module, op):
                    rec.record("grad", module, op, key, ordinal, grad, [grad])
        finally:
            rec.busy = False
