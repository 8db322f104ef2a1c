"""Run a generated kernel, on the GPU or through the Triton interpreter.

Every launch goes through ``run`` so that the choice of interpreter, the
optional recording of launches for ahead-of-time compilation checks
(``flexgen.runtime.aot``), autotuned tiles, the step-down of tiles that do not fit
and the warm path's shortcuts live in one place. On a GPU a kernel is compiled
and launched through the CUDA driver API (``flexgen.runtime.driver``: no C
launcher for gcc to build, no JIT binding per call), or where that declines
through Triton's JIT; either way later launches of the same specialization
call the loaded kernel directly (``_launch_compiled``), and a caller that
repeats a planned call can ``Replay`` it with new leading tensors.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading

import weakref

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime import collector, compiler_key, driver, tuning
from ..codegen import cache
from ..codegen.spec import KernelSpec

# When a list, every launch appends (spec, args, constexprs): flexgen.runtime.aot
# compiles each recorded kernel for a GPU target the machine may not have.
RECORDED: list | None = None

# Sigmoid kernels compute sigmoid(x) = 0.5 tanh(x / 2) + 0.5 with tanh.approx.f32 on the GPU;
# FLEXGEN_EXACT_SIGMOID=1 makes them use 1 / (1 + 2^e) there too (to compare the two).
EXACT_SIGMOID = os.environ.get("FLEXGEN_EXACT_SIGMOID", "0") not in ("", "0")

_INTERPRETED: dict = {}
_PATCH_LOCK = threading.RLock()


def uses_interpreter(device: torch.device) -> bool:
    """CPU tensors run through the Triton interpreter; CUDA tensors run compiled."""
    return device.type != "cuda"


@contextlib.contextmanager
def _library_interpreted():
    """Let interpreted kernels call triton.language's own @jit helpers (tl.zeros, tl.max, ...).

    Triton decides at its import whether those helpers are interpreted. flexgen
    loads each kernel for the mode its tensors need, so one process can run
    CPU tensors through the interpreter and still compile for the GPU: while an
    interpreted kernel runs, a call of a compiled helper is interpreted too.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def interpreted_call(self, *args, **kwargs):
        # Run the helper's rewritten Python directly: the kernel's launch has
        # already patched triton.language (and restores it afterwards), while
        # InterpretedFunction.__call__ would patch again and never restore.
        fn = _INTERPRETED.get(self.fn)
        if fn is None:
            fn = _INTERPRETED[self.fn] = InterpretedFunction(self.fn).rewrite()
        return fn(*args, **kwargs)

    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        # Older interpreters (triton 3.6) turn a scalar into an int with int() of a
        # 1-element array, which numpy >= 2.4 refuses: `range(tl.cdiv(n, BLOCK))`
        # in a kernel then fails. Take the element out first.
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with _PATCH_LOCK:
        original = JITFunction.__call__
        JITFunction.__call__ = interpreted_call
        interpreter._patch_lang_tensor = patch_tensor_with_index
        try:
            yield
        finally:
            JITFunction.__call__ = original
            interpreter._patch_lang_tensor = patch_tensor


def run(spec: KernelSpec, device: torch.device, inputs: dict, tune_blocks: tuple | None = None,
        replay: tuple = (), origins: tuple = ()):
    """Launch ``spec``'s kernel on ``inputs`` (the keyword arguments its module's ``arguments`` takes).

    ``tune_blocks`` (the sparse block sizes) marks a launch whose tiles the
    caller left to flexgen: on a GPU it may launch an autotuned winner instead
    (``flexgen.runtime.tuning``). With ``replay`` (the call's tensors that change from
    call to call, None for one it lacks) it returns a ``Replay`` of this launch for a
    later call with new such tensors (or None where replaying is not possible);
    ``origins``: the tensors whose addresses the caller keys that replay on (captured
    tensors, block lists), which the other kernel arguments may view (see ``Replay``).
    """
    if tune_blocks is not None and device.type == "cuda" and tuning.needs_lookup():
        # The search must see a candidate that does not fit fail, not quietly shrink.
        spec = tuning.choose(spec, device, inputs, tune_blocks,
                             lambda s: _launch_once(s, device, inputs))
        replay = ()         # a size bucket's winner can change while the process tunes
    launched = _launch(spec, device, inputs)
    if replay and launched is not None and RECORDED is None:
        return Replay.of(*launched, replay, origins)
    return None


def _recorded(arg):
    """What a recorded launch keeps of an argument: a tensor (also a descriptor's base) as a
    one-element meta tensor of its dtype, at an address as aligned as the tensor's (a meta
    tensor's is its offset; Triton specializes a pointer on its 16-byte alignment): all the
    ahead-of-time compile reads. Holding the real one kept memory of a CUDA graph's pool
    alive past the graph (torch.compile's reduce-overhead refuses that)."""
    if isinstance(arg, torch.Tensor):
        stand_in = torch.empty(2, dtype=arg.dtype, device="meta")     # (an empty one's is 0)
        return stand_in[:1] if arg.data_ptr() % 16 == 0 else stand_in[1:]
    if isinstance(getattr(arg, "base", None), torch.Tensor):     # a TMA descriptor
        stand_in = copy.copy(arg)
        object.__setattr__(stand_in, "base", _recorded(arg.base))
        return stand_in
    return arg


class Replay:
    """A launch made again with new tensors, nothing else recomputed.

    For a caller that knows every other argument is unchanged (the same planned call,
    so the same shapes, strides, block mask and captured tensors: ``replay_key`` in
    ``flexgen.kernels.forward``). The tensors that change (``fresh``) are found among
    the arguments by identity, as themselves or as the base of a TMA descriptor (a
    copy of which takes the new tensor: the same shapes and strides). ``__call__``
    returns False, launching nothing, when the new tensors differ in what Triton
    specializes on (dtype, 16-byte alignment), alias one another otherwise than the
    first ones did, or the current device changed; the caller then launches normally.
    """

    @classmethod
    def of(cls, launcher, grid, args, device_index, fresh, origins=()):
        """The Replay of a launch, or None where an argument is a descriptor over a tensor
        that is not among ``fresh`` (it would have to be rebuilt)."""
        slots = {id(t): i for i, t in enumerate(fresh) if t is not None}
        for a in args:
            base = getattr(a, "base", None)
            if isinstance(base, torch.Tensor) and id(base) not in slots:
                return None
        return cls(launcher, grid, args, device_index, fresh, origins)

    def __init__(self, launcher, grid, args, device_index, fresh, origins=()):
        self.launcher, self.device_index = launcher, device_index
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.signature = fresh_signature(fresh)
        slots = {id(t): i for i, t in enumerate(fresh) if t is not None}
        # (argument position, index in fresh, the descriptor to copy or None)
        self.swaps = []
        # The other tensors (captured tensors, block lists): an argument at the address of
        # one of ``origins``, which the caller's key holds the addresses of (a view made per
        # call, such as a block list broadcast over heads, lies at its origin's), is launched
        # at that address: a call with the same key has its tensors there. Any other is
        # held weakly: a Replay kept in a plan must not keep it alive (a CUDA graph's pool
        # refuses tensors that outlive its outputs, and a user's freed mask should be freed),
        # and declines once it is gone. The launcher reads each pointer through data_ptr().
        at = {o.data_ptr() for o in origins}
        rest = []
        for pos, a in enumerate(args):
            base = getattr(a, "base", None)
            if isinstance(a, torch.Tensor) and id(a) in slots:
                self.swaps.append((pos, slots[id(a)], None))
                a = None
            elif isinstance(base, torch.Tensor):
                self.swaps.append((pos, slots[id(base)], _recorded(a)))
                a = None
            elif isinstance(a, torch.Tensor):
                a = _Address(a.data_ptr()) if a.data_ptr() in at else _Weak(a)
            rest.append(a)
        self.args = tuple(rest)
        self.weak = tuple(a.ref for a in self.args if type(a) is _Weak)
        # A driver launch packs only the fresh tensors per call (driver.Binary.replayer).
        replayer = getattr(launcher, "replayer", None)
        self.pack = None if replayer is None else replayer(self.args, self.swaps)

    def __call__(self, *tensors) -> bool:
        return fresh_signature(tensors) == self.signature and self.launch(*tensors)

    def launch(self, *tensors) -> bool:
        """Launch with ``tensors``, which the caller knows match ``signature`` (the same
        aliasing, dtypes and 16-byte alignment as at the first launch: a kernel specialized on an
        aligned pointer must never get another); False, launching nothing, where Triton's
        own path must run instead."""
        if RECORDED is not None or _current_device() != self.device_index or not _hooks_idle():
            return False
        for ref in self.weak:
            if ref() is None:
                return False
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        if self.pack is not None:
            self.launcher.launch_packed(self.grid, stream, self.pack(tensors))
            return True
        args = list(self.args)
        for pos, i, descriptor in self.swaps:
            if descriptor is None:
                args[pos] = tensors[i]
            else:
                args[pos] = copy.copy(descriptor)
                object.__setattr__(args[pos], "base", tensors[i])
        self.launcher.launch(self.grid, stream, args)
        return True


def fresh_signature(tensors) -> tuple:
    """What a replay's new tensors must share with the first ones, in one pass (it runs at every
    replayed launch, ~12 tensors): per tensor, None for None; for a repeat of an earlier one
    (the same object) that one's index; else its dtype and whether its address is 16-byte
    aligned, what Triton specializes a pointer on."""
    first: dict = {}
    signature = []
    for i, t in enumerate(tensors):
        if t is None:
            signature.append(None)
            continue
        j = first.setdefault(id(t), i)
        signature.append((t.dtype, not t.data_ptr() & 15) if j == i else j)
    return tuple(signature)


class _Weak:
    """A kernel's tensor argument held by a weak reference: the launchers take any object
    with ``data_ptr()``."""
    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)

    def data_ptr(self) -> int:
        return self.ref().data_ptr()


class _Address:
    """A kernel's tensor argument as its address (see ``Replay``)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """The number of multiprocessors of a CUDA ``device`` (read once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


# At most this many programs per multiprocessor, a grid of attention programs is taken
# block-major (common.program_block: every (batch, head) row's first block before any row's
# second); above it, row by row. The GPU hands programs out in grid order, and a causal
# mask's programs differ in length: in few waves, row order ends the grid on one row's long
# programs (H200, causal, D=128: 16 heads over 8 KV heads at 8k, forward 0.43 ms against
# 0.46-0.48 and backward 1.52 against 1.69-1.84; 32 over 8 at 4k, 0.35 against 0.39-0.42
# and 0.94 against 1.11-1.12). In many waves that tail is small and rows keep each one's
# K and V (or Q and dO) shared in L2 (16 heads at 16k, 15.5 waves: block-major ran the
# forward 2-7% and the backward 3-5% slower).
BLOCK_MAJOR_WAVES = 8
CPU_SMS = 132           # (the interpreter: as an H100, so small test grids take block-major)


def waves(programs: int, device: torch.device) -> float:
    """How many waves of one program per multiprocessor ``programs`` make on ``device``."""
    return programs / (sm_count(device) if device.type == "cuda" else CPU_SMS)


def block_major(programs: int, device: torch.device) -> bool:
    """Whether a grid of ``programs`` attention programs on ``device`` is taken block-major."""
    return waves(programs, device) <= BLOCK_MAJOR_WAVES


# spec key -> the smaller spec that fits: a mod that keeps more tiles live (a
# gathered bias table, say) can need more shared memory than the table's tiles allow.
_FITS: dict = {}


def _launch(spec: KernelSpec, device: torch.device, inputs):
    """Launch, stepping down to smaller tiles when the GPU says they do not fit.

    Returns what ``_launch_once`` does."""
    from triton.runtime.errors import OutOfResources

    first = spec
    spec = _FITS.get(first.key, first)
    while True:
        try:
            launched = _launch_once(spec, device, inputs)
            break
        except OutOfResources:
            smaller = tuning.smaller(spec) if not uses_interpreter(device) else None
            if smaller is None:
                raise
            spec = smaller
    if spec is not first:
        _FITS[first.key] = spec
    return launched


def _launch_once(spec: KernelSpec, device: torch.device, inputs):
    """Launch once; on a GPU, returns (launcher, grid, args, device index) of a launch that
    can be replayed, else None."""
    interpret = uses_interpreter(device)
    module = cache.load(spec, interpret=interpret)
    grid, args, constexprs = module.arguments(**inputs)
    if RECORDED is not None:
        RECORDED.append((spec, tuple(_recorded(a) for a in args), constexprs))
    constexprs = _mode_constexprs(spec, module, constexprs, interpret)
    if interpret:
        options = driver.compile_options(module)
        with _library_interpreted():
            module.KERNEL[grid](*args, **constexprs, **options)
        return None
    return _launch_compiled(spec, module, grid, args, constexprs)


def _mode_constexprs(spec: KernelSpec, module, constexprs: dict, interpret: bool) -> dict:
    """The constexprs that depend on where the kernel runs (interpreter or GPU)."""
    if "DOT_UPCAST" in module.KERNEL.arg_names:
        # The interpreter's bf16 tl.dot is wrong; kernels multiply in float32 there.
        constexprs = dict(constexprs, DOT_UPCAST=interpret)
    if "EXACT_SIGMOID" in module.KERNEL.arg_names:
        # Sigmoid kernels: tanh.approx (PTX) on the GPU for half inputs (cache.half_inputs),
        # the exact formula where no PTX runs and for float32.
        constexprs = dict(constexprs, EXACT_SIGMOID=interpret or EXACT_SIGMOID
                          or not cache.half_inputs(spec))
    return constexprs


def ready(spec: KernelSpec, device: torch.device, inputs: dict) -> bool:
    """Whether launching ``spec`` on ``inputs`` now needs no compile: its kernel is loaded in
    this process, or a previous process recorded its binary in the restart index (loaded
    here, for the launch that follows). False on the interpreter (no compiled kernel runs
    there) and where Triton's own launch path would run.

    For a caller with a cheaper way than a first compile (create_block_mask's torch ops
    for a mask built once)."""
    if uses_interpreter(device) or not driver.usable() or not cache.loaded_or_recorded(spec):
        return False
    module = cache.load(spec, interpret=False)
    _, args, constexprs = module.arguments(**inputs)
    constexprs = _mode_constexprs(spec, module, constexprs, False)
    classes = _arg_classes(args)
    if classes is None or not _hooks_idle():
        return False
    key = (spec.key, torch.cuda.current_device(), classes, *constexprs.values())
    return _launcher(key, spec, module, args, constexprs, compile_missing=False) is not None


# Direct launches. Triton's ``kernel[grid](...)`` binds every argument, works
# out its specialization (dtype and 16-byte alignment of each pointer, whether
# each int is 1 or a multiple of 16) and looks the compiled kernel up: about
# 30 us a call for ~40 arguments, more than the whole launch should take. Here
# a launch's key is the argument classes Triton specializes on (computed in
# plain Python, finer than Triton's), mapped to the launcher of the kernel
# compiled the first time (a ``driver.Binary``, or Triton's own ``_TritonLauncher``).
# (spec key, device index, argument classes, constexpr values) -> launcher
_COMPILED: dict = {}
_COMPILED_MAX = 1024


class _TritonLauncher:
    """A kernel Triton's JIT compiled, called through Triton's C launcher: every parameter
    in signature order, the constexprs (``tail``) last."""
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel, tail: tuple):
        self.kernel, self.tail = kernel, tail

    def launch(self, grid, stream: int, args) -> None:
        g = tuple(grid) + (1, 1)
        kernel = self.kernel
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *self.tail)


def _arg_classes(args) -> tuple | None:
    """What Triton specializes each argument on, or None for a type this does not handle."""
    classes = []
    for a in args:
        t = type(a)
        if t is int:
            if -2**31 <= a < 2**31:
                classes.append(1 if a == 1 else 16 if a % 16 == 0 else 0)
            else:       # i64 or u64, and still whether it is a multiple of 16
                classes.append((64 if -2**63 <= a < 2**63 else 65, a % 16 == 0))
        elif t is float:
            classes.append(2)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            classes.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is TensorDescriptor or t is _gluon_descriptor():
            # Triton specializes a host TMA descriptor on its dtype and block shape only
            # (the launcher encodes base, shape and strides at each launch).
            classes.append((a.base.dtype, tuple(a.block_shape)))
        else:
            return None     # bool, None, descriptors, ...: Triton's own path
    return tuple(classes)


def _gluon_descriptor():
    """Gluon's host TMA descriptor class (it also carries the shared layout), or None while
    no Gluon kernel is loaded: importing Gluon costs ~0.15 s of a process's first call,
    and only a Gluon kernel's module (which imports it) builds one."""
    hopper = sys.modules.get("triton.experimental.gluon.nvidia.hopper")
    return getattr(hopper, "TensorDescriptor", None)


def _idle(hook) -> bool:
    """No launch hook is set (a profiler such as proton sets one: then Triton's path runs it)."""
    return hook is None or getattr(hook, "calls", None) == []


def _hooks_idle() -> bool:
    hooks = triton.knobs.runtime
    return _idle(hooks.launch_enter_hook) and _idle(hooks.launch_exit_hook)


def _current_device() -> int:
    """``torch.cuda.current_device()`` without its lazy-initialization check (~1 us on a
    slow host): only called once a launch on the GPU has initialized CUDA."""
    return torch._C._cuda_getDevice()


def _compile_hooks_idle() -> bool:
    """No JIT compile hook is set (a tool watching Triton's compiles: then Triton's path runs)."""
    hooks = triton.knobs.runtime
    return hooks.jit_cache_hook is None and hooks.jit_post_compile_hook is None


def _launch_compiled(spec: KernelSpec, module, grid, args, constexprs):
    """Launch on the GPU; returns (launcher, grid, args, device index) when the launch went
    through a launcher flexgen can call again directly, else None."""
    device_index = torch.cuda.current_device()
    classes = _arg_classes(args)
    key = None
    if classes is not None and _hooks_idle():
        key = (spec.key, device_index, classes, *constexprs.values())
        launcher = _launcher(key, spec, module, args, constexprs)
        if launcher is not None:
            launcher.launch(grid, torch._C._cuda_getCurrentRawStream(device_index), args)
            return launcher, grid, args, device_index
    options = driver.compile_options(module)
    compiler_key.install()
    with collector.paused():        # a first launch compiles
        kernel = module.KERNEL[grid](*args, **constexprs, **options)
    names = module.KERNEL.arg_names
    if key is not None and kernel is not None and set(names[len(args):]) == set(constexprs):
        # The launcher takes every parameter in signature order; it skips the constexprs.
        launcher = _TritonLauncher(kernel, tuple(constexprs[n] for n in names[len(args):]))
        _remember(key, launcher)
        return launcher, grid, args, device_index
    return None


def _launcher(key, spec: KernelSpec, module, args, constexprs, compile_missing: bool = True):
    """The launcher kept under ``key`` (spec key, device index, argument classes, constexpr
    values), or the driver's Binary for it, loaded from the restart index or compiled
    (``compile_missing``) and kept; None where the driver declines (Triton's path then)."""
    launcher = _COMPILED.get(key)
    if launcher is None and driver.usable() and _compile_hooks_idle():
        compiler_key.install()
        with collector.paused():
            launcher = driver.load(module, spec.key, key[2], args, constexprs, key[1],
                                   compile_missing=compile_missing)
        if launcher is not None:
            _remember(key, launcher)
    return launcher


def _remember(key, launcher) -> None:
    if len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.clear()
    _COMPILED[key] = launcher


def clear_memos() -> None:
    _COMPILED.clear()
    driver.clear_memos()
    _FITS.clear()
    _INTERPRETED.clear()
