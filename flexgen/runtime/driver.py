"""Compile and launch generated kernels without Triton's launchers: the CUDA driver API.

Triton 3.6 launches a kernel through a C extension it builds with gcc, one per
kernel signature, and through a ``cuda_utils`` extension built the same way once
per empty cache; its JIT also binds and specializes every call in Python. In a
cold process those builds cost ~0.3-0.5 s each, a large part of a first call
(issue: fast restarts). flexgen instead:

- compiles with ``triton.compile`` after the JIT's own specialization rules
  (``compile_for_device``: the binder Triton generates for the kernel, so the signature,
  the divisibility attributes and the ints specialized to 1 are Triton's, and so
  is the cache entry), never touching Triton's driver object;
- loads the cubin with ``cuModuleLoadData`` and launches it with ``cuLaunchKernel``
  through ctypes (``Binary``), the parameters packed with one ``struct.pack_into``.

The parameter layout is Triton's launcher's: the arguments that are not
constexprs, in order; a host TMA descriptor as its 128-byte ``CUtensorMap``
followed by its shape (i32) and strides (i64); then the global and profile
scratch pointers. ``Binary.of`` checks that layout against the kernel's PTX
entry, parameter by parameter, and declines (None) anything it does not cover
(a cluster or cooperative launch, a scratch buffer, a descriptor lowered to
pointers, a Triton whose layout differs): the caller then launches through
Triton's own path, as it does when a profiler's launch hook is set.

``FLEXGEN_DRIVER_LAUNCH=0`` turns this off.
"""
from __future__ import annotations

import base64
import ctypes
import functools
import os
import re
import struct
import threading

import torch

ENABLED = os.environ.get("FLEXGEN_DRIVER_LAUNCH", "1") not in ("", "0")

_CUDA: list = []            # [the loaded libcuda, or None where it cannot be loaded]
_LOCK = threading.Lock()

# CUDA driver enums (cuda.h)
_FUNC_MAX_THREADS_PER_BLOCK = 0
_FUNC_SHARED_SIZE_BYTES = 1
_FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_L2_PROMOTION_128B = 2
_OOB_FILL_NAN = 1
# Triton's TMA element types are numbered as on the device; the host enum swaps three.
_TMA_HOST_TYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_TMA_TF32 = 11


def _cuda():
    """libcuda through ctypes, or None where there is none (a CPU-only machine)."""
    if not _CUDA:
        with _LOCK:
            if not _CUDA:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError:
                    lib = None
                if lib is not None:
                    p, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
                    lib.cuLaunchKernel.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
                    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(p), ctypes.c_char_p]
                    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(p), p, ctypes.c_char_p]
                    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(i), i, p]
                    lib.cuFuncSetAttribute.argtypes = [p, i, i]
                    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(i), i, i]
                    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(p)]
                    lib.cuCtxSetCurrent.argtypes = [p]
                    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), i]
                    lib.cuGetErrorString.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
                    lib.cuTensorMapEncodeTiled.argtypes = [p, i, u, p, p, p, p, p, i, i, i, i]
                _CUDA.append(lib)
    return _CUDA[0]


def usable() -> bool:
    return ENABLED and _cuda() is not None


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else f"error {result}"
        raise RuntimeError(f"CUDA driver: {what} failed: {message}")


# ----------------------------------------------------------------------------- compiling

_TARGETS: dict = {}


def target(device_index: int):
    """Triton's compile target for a CUDA device (its capability; warps of 32)."""
    found = _TARGETS.get(device_index)
    if found is None:
        from triton.backends.compiler import GPUTarget
        major, minor = torch.cuda.get_device_capability(device_index)
        found = _TARGETS[device_index] = GPUTarget("cuda", major * 10 + minor, 32)
    return found


def compile_options(module) -> dict:
    """The options every compile of a generated module takes (JIT launch, driver, ahead of time).

    FP fusion (a * b + c as one FMA) is pinned on: it is Triton's default up to 3.9, which
    warns that 3.10 turns it off unless asked. The kernels were tuned and checked with it,
    and a silent flip would slow every elementwise chain and change its rounding."""
    return dict(num_warps=module.NUM_WARPS, num_stages=getattr(module, "NUM_STAGES", 1),
                enable_fp_fusion=True)


class Unsupported(Exception):
    """This Triton's JIT internals are not the ones ``compile_for_device`` reproduces."""


def compile_for_device(module, args, constexprs: dict, target):
    """Triton's compiled kernel of ``module.KERNEL`` for a launch with ``args`` and
    ``constexprs`` on ``target``, specialized exactly as Triton's JIT would (its generated
    binder and argument packing: the same kernel, the same cache entry).

    Those are Triton's internals (3.6 to 3.9 have them): on a Triton whose binder or
    packing differ it raises ``Unsupported``, and ``load`` declines (Triton's JIT then
    launches the kernel). Compile errors propagate as they are."""
    import triton
    from triton.compiler import ASTSource

    kernel = module.KERNEL
    backend, options, (bound, specialization, options_in) = _bind(module, args, constexprs, target)
    try:
        parsed, signature, fixed, attrs = kernel._pack_args(backend, options, bound,
                                                            specialization, options_in)
    except (AttributeError, TypeError, ValueError) as exc:
        raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
    source_class = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_class
    source = source_class(kernel, signature, fixed, attrs)
    return triton.compile(source, target=target, options=parsed.__dict__)


def specialization(module, args, constexprs: dict, target) -> list:
    """Triton's JIT specialization of a launch of ``module.KERNEL`` with ``args`` (its binder's):
    per parameter (type, attribute), e.g. ("*bf16", "D") for a pointer taken as 16-byte aligned,
    ("i32", "D") for a multiple of 16, ("constexpr", 1) for an int of 1. Raises ``Unsupported``
    where this Triton's binder differs (``compile_for_device``)."""
    return _bind(module, args, constexprs, target)[2][1]


def _bind(module, args, constexprs: dict, target) -> tuple:
    """(backend, the compile's options, Triton's binder's (bound arguments, specialization,
    options)) of a launch, as Triton's JIT binds it; ``Unsupported`` where its internals differ."""
    from triton import knobs
    from triton.compiler import make_backend
    kernel = module.KERNEL
    backend = make_backend(target)
    options = dict(constexprs, **compile_options(module),
                   debug=kernel.debug or knobs.runtime.debug,
                   instrumentation_mode=knobs.compilation.instrumentation_mode)
    try:
        binder = _BINDERS.get((kernel, str(target)))
        if binder is None:
            from triton.runtime.jit import create_function_from_signature
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            if len(_BINDERS) >= _BINDERS_MAX:
                _BINDERS.clear()
            _BINDERS[(kernel, str(target))] = binder
        return backend, options, binder(*args, **options)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise Unsupported(f"{type(exc).__name__}: {exc}") from exc


# (kernel, target) -> Triton's binder of its arguments (generated code: ~0.3 ms to make; the
# test suite binds every recorded launch, ``aot.arg_types``)
_BINDERS: dict = {}
_BINDERS_MAX = 256


# ----------------------------------------------------------------------------- parameters

_PTX_TYPES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_params(ptx: str, name: str) -> list:
    """(size, alignment) in bytes of each parameter of entry ``name`` in ``ptx``."""
    entry = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if entry is None:
        return []
    params = []
    for text in entry.group(1).split(","):
        kind = re.search(r"\.[usbf](8|16|32|64)\b", text)
        if kind is None:
            return []
        size = _PTX_TYPES[kind.group(1)]
        count = re.search(r"\[(\d+)\]", text)
        align = re.search(r"^\s*\.param\s+\.align\s+(\d+)", text)
        params.append((size * (int(count.group(1)) if count else 1),
                       int(align.group(1)) if align else size))
    return params


# Triton's scalar types -> struct codes (little-endian, no implicit padding: '<')
_SCALARS = {"i1": "B", "i8": "b", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
            "i64": "q", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}


def _layout(compiled, n_args: int):
    """(struct format, offsets of the parameters, kinds) of a compiled kernel whose first
    ``n_args`` arguments are the launch's; None where this module cannot launch it (see the
    module docstring). ``kinds``: for each argument that is a parameter, in order, (its
    position, "ptr" | "desc" | a struct code); a descriptor's metadata comes in the
    kernel's order (``_descriptor_metas``)."""
    metadata = compiled.metadata
    names = list(compiled.src.signature)
    types = list(compiled.src.signature.values())
    if len(names) < n_args or any(t != "constexpr" for t in types[n_args:]):
        return None
    descriptors = list(getattr(metadata, "tensordesc_meta", None) or [])
    codes, kinds = [], []
    for i, ty in enumerate(types[:n_args]):
        if not isinstance(ty, str):
            return None                     # a tuple argument
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            codes.append("Q")
            kinds.append((i, "ptr"))
        elif ty.startswith("tensordesc"):
            if not descriptors:
                return None                 # lowered to pointers: not this layout
            meta = descriptors.pop(0)
            if meta.get("fp4_padded") or meta.get("is_im2col"):
                return None
            rank = len(meta["block_size"])
            codes += ["128s"] + ["i"] * rank + ["q"] * rank
            kinds.append((i, "desc"))
        elif ty in _SCALARS:
            codes.append(_SCALARS[ty])
            kinds.append((i, _SCALARS[ty]))
        else:
            return None
    if descriptors:
        return None
    codes += ["Q", "Q"]                     # global and profile scratch: none
    # Lay the parameters out at their alignments, and check them against the PTX entry.
    expected = ptx_params(compiled.asm["ptx"], metadata.name)
    if len(expected) != len(codes):
        return None
    fmt, offsets, offset = "<", [], 0
    for code, (size, align) in zip(codes, expected):
        if struct.calcsize("<" + code) != size:
            return None
        align = max(align, 64 if code == "128s" else 1)
        pad = -offset % align
        fmt += "x" * pad + code
        offset += pad
        offsets.append(offset)
        offset += size
    return fmt, offsets, kinds


def decline_reason(compiled, n_args: int) -> str | None:
    """Why ``Binary.of`` would decline a compiled kernel launched with ``n_args`` positional
    arguments (Triton's own launcher then runs it), or None. The test suite asks this of
    every kernel it compiles for sm_90, so a kernel that would lose the fast path fails there."""
    return _checked_layout(compiled, n_args)[0]


def _checked_layout(compiled, n_args: int) -> tuple:
    """(why the kernel is declined or None, its ``_layout`` where it is not)."""
    metadata = compiled.metadata
    for name, fine in (("num_ctas", 1), ("global_scratch_size", 0), ("profile_scratch_size", 0),
                       ("launch_cooperative_grid", False), ("launch_pdl", False)):
        value = getattr(metadata, name, fine)
        if value != fine:
            return f"its metadata has {name}={value!r} (this launcher handles {fine!r} only)", None
    layout = _layout(compiled, n_args)
    if layout is None:
        return ("its parameters do not lay out as Triton's launcher passes them, checked "
                "against the PTX entry"), None
    return None, layout


# ----------------------------------------------------------------------------- TMA descriptors

_ENCODED: dict = {}
_ENCODED_MAX = 4096


def _descriptor(desc, meta: tuple) -> tuple:
    """A host TMA descriptor's launch parameters: (CUtensorMap bytes, *shape, *strides).
    ``meta``: the compiled kernel's (swizzle, element size, element type, box) for it."""
    return _descriptor_at(desc.base.data_ptr(), *_descriptor_fields(desc), meta)


def _descriptor_fields(desc) -> tuple:
    """What a descriptor's map depends on besides its base and the kernel's metadata."""
    return (tuple(desc.shape), tuple(desc.strides), getattr(desc, "padding", "zero") == "nan",
            bool(getattr(desc, "round_f32_to_tf32", False)))


def _descriptor_at(ptr: int, shape: tuple, strides: tuple, nan: bool, tf32: bool, meta: tuple) -> tuple:
    """``_descriptor`` from its fields. The encoded map depends on nothing else, so it is kept
    by those values (a replay's tensors come back at the same addresses: no encoding then)."""
    key = (ptr, shape, strides, nan, tf32, meta)
    encoded = _ENCODED.get(key)
    if encoded is None:
        encoded = _encode(ptr, shape, strides, meta, nan, tf32)
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        _ENCODED[key] = encoded
    return (encoded, *shape, *strides)


def _encode(ptr, shape, strides, meta: tuple, nan: bool, tf32: bool) -> bytes:
    swizzle, size, elem_type, block = meta
    rank = len(shape)
    if strides[-1] != 1:
        raise RuntimeError(f"TMA descriptor: the last stride must be 1, got strides {strides}")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * rank)(*reversed(shape))
    # cuda.h: the strides of dims 1.. in bytes, innermost first
    byte_strides = (u64 * max(1, rank - 1))(*[s * size for s in reversed(strides[:-1])])
    box = (u32 * rank)(*reversed(block))
    ones = (u32 * rank)(*([1] * rank))
    raw = ctypes.create_string_buffer(128 + 64)
    at = ctypes.addressof(raw) + (-ctypes.addressof(raw) % 64)     # CUtensorMap is 64-aligned
    kind = _TMA_TF32 if tf32 else _TMA_HOST_TYPE[elem_type]
    _check(_cuda().cuTensorMapEncodeTiled(
        at, kind, rank, ptr, dims, byte_strides, box, ones, 0, swizzle,
        _L2_PROMOTION_128B, _OOB_FILL_NAN if nan else 0),
        f"cuTensorMapEncodeTiled (shape {shape}, strides {strides}, box {block})")
    return ctypes.string_at(at, 128)


# ----------------------------------------------------------------------------- loading

def load(module, spec_key: str, classes: tuple, args, constexprs: dict, device_index: int,
         compile_missing: bool = True):
    """The Binary for a launch of ``module``'s kernel (spec ``spec_key``, its arguments of
    ``classes`` as ``flexgen.runtime.launch`` keys them): from the restart index where a
    previous process recorded it (no specialization, no ``triton.compile``: a warm
    restart's first call), else compiled now and recorded (None instead without
    ``compile_missing``). None where ``Binary.of`` declines the kernel."""
    from ..codegen import index
    key = _index_key(module, spec_key, classes, constexprs, device_index)
    entry = index.get("binary", key, memo=False)
    if isinstance(entry, dict):
        try:
            return Binary(dict(entry, cubin=base64.b64decode(entry["cubin"])), device_index)
        except (KeyError, TypeError, ValueError, struct.error):
            pass        # another flexgen's layout: compile again
    if not compile_missing:
        return None
    try:
        compiled = compile_for_device(module, args, constexprs, target(device_index))
    except Unsupported:
        return None
    binary = Binary.of(compiled, len(args), device_index)
    if binary is not None:
        index.put("binary", key, dict(binary.kernel, cubin=base64.b64encode(binary.kernel["cubin"]).decode()),
                  memo=False)
    return binary


def _index_key(module, spec_key, classes, constexprs, device_index) -> str:
    """What a compiled binary depends on beyond flexgen's sources and Triton's version (the
    index's fingerprint): the kernel spec, the module's compile-time globals, the argument
    classes Triton specializes on, the constexprs, the GPU, Triton's compiler key, the
    environment variables that change its compiles, and its debug switch."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import triton_key
    environment = sorted(get_cache_invalidating_env_vars().items())
    fast_tanh = bool(getattr(module, "FAST_TANH", False))
    return repr((spec_key, fast_tanh, classes, sorted(constexprs.items()), str(target(device_index)),
                 triton_key(), environment, bool(knobs.runtime.debug)))


# ----------------------------------------------------------------------------- launching

class Binary:
    """A compiled kernel loaded into the current CUDA context, launched with ``launch``."""

    @classmethod
    def of(cls, compiled, n_args: int, device_index: int):
        """The Binary of ``compiled`` for launches with ``n_args`` positional arguments, or
        None where this module does not launch it (Triton's path runs instead). Raises
        Triton's OutOfResources where the GPU cannot run it, as Triton's loader does."""
        reason, layout = _checked_layout(compiled, n_args)
        if reason is not None:
            return None
        metadata = compiled.metadata
        return cls(dict(name=metadata.name, cubin=compiled.asm["cubin"], num_warps=metadata.num_warps,
                        shared=metadata.shared, layout=layout, metas=_descriptor_metas(metadata)),
                   device_index)

    def __init__(self, kernel: dict, device_index: int):
        """``kernel``: name, cubin (bytes), num_warps, shared (bytes), layout (``_layout``'s
        format, offsets and kinds), metas (``_descriptor_metas``)."""
        from triton.runtime.errors import OutOfResources
        lib = _cuda()
        fmt, offsets, kinds = kernel["layout"]
        self.kernel = kernel
        self.name = kernel["name"]
        self.threads = 32 * kernel["num_warps"]
        self.shared = kernel["shared"]
        _current_context(device_index)
        optin = ctypes.c_int()
        _check(lib.cuDeviceGetAttribute(ctypes.byref(optin), _DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                        device_index), "cuDeviceGetAttribute")
        if self.shared > optin.value:
            raise OutOfResources(self.shared, optin.value, "shared memory")
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(module), kernel["cubin"]), "cuModuleLoadData")
        _check(lib.cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()),
               "cuModuleGetFunction")
        self.module, self.function = module, function
        most = ctypes.c_int()
        _check(lib.cuFuncGetAttribute(ctypes.byref(most), _FUNC_MAX_THREADS_PER_BLOCK, function),
               "cuFuncGetAttribute")
        if self.threads > most.value:
            raise OutOfResources(self.threads, most.value, "threads")
        if self.shared > 49152:
            static = ctypes.c_int()
            _check(lib.cuFuncGetAttribute(ctypes.byref(static), _FUNC_SHARED_SIZE_BYTES, function),
                   "cuFuncGetAttribute")
            _check(lib.cuFuncSetAttribute(function, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          optin.value - static.value), "cuFuncSetAttribute")
        self.fmt = fmt
        size = struct.calcsize(fmt)
        self._raw = ctypes.create_string_buffer(size + 64)
        base = ctypes.addressof(self._raw) + (-ctypes.addressof(self._raw) % 64)
        self.buffer = (ctypes.c_char * size).from_address(base)
        self.params = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.kinds = [tuple(k) for k in kinds]
        self.metas = [tuple(m[:3]) + (tuple(m[3]),) for m in kernel["metas"]]
        self.pack = _packer(self.kinds, self.metas, lambda i: f"a[{i}]", {})
        self._lock = threading.Lock()
        self._launch = lib.cuLaunchKernel

    def launch(self, grid, stream: int, args) -> None:
        """Launch on ``stream`` (a raw CUstream) with the grid and arguments a generated
        module's ``arguments`` gave (their first ``n_args``; constexprs are not parameters)."""
        self.launch_packed(tuple(grid) + (1,) * (3 - len(grid)), stream, self.pack(args))

    def replayer(self, args, swaps):
        """A packer for replays of one launch (``launch.Replay``): only the fresh tensors are
        read per call; every other argument (``args``, with None at the swapped positions) is
        an object kept as it is (a scalar, or one whose ``data_ptr()`` is read). ``swaps``:
        (argument position, index among the fresh tensors, the recorded descriptor or None)."""
        fresh = {pos: (j, descriptor) for pos, j, descriptor in swaps}
        constants = {}
        for pos, (j, descriptor) in fresh.items():
            if descriptor is not None:
                constants[f"t{pos}"] = _descriptor_fields(descriptor)
        for pos, a in enumerate(args):
            if pos not in fresh:
                constants[f"c{pos}"] = a
        return _packer(self.kinds, self.metas,
                       lambda i: f"a[{fresh[i][0]}]" if i in fresh else f"c{i}", constants)

    def launch_packed(self, grid, stream: int, values) -> None:
        """``launch`` with the parameter values already packed (a replayer's), on a grid of 3."""
        if grid[0] * grid[1] * grid[2] == 0:
            return
        with self._lock:        # one parameter buffer; the driver copies it at the launch
            struct.pack_into(self.fmt, self.buffer, 0, *values)
            result = self._launch(self.function, grid[0], grid[1], grid[2], self.threads, 1, 1,
                                  self.shared, stream, self.params, None)
        if result != 0:
            _check(result, f"cuLaunchKernel of {self.name}")


def _descriptor_metas(metadata) -> list:
    """(swizzle, element size, element type, box) of each of a kernel's TMA descriptors."""
    return [(m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]))
            for m in getattr(metadata, "tensordesc_meta", None) or []]


def _packer(kinds, metas, access, constants: dict):
    """A function ``pack(a)`` -> the tuple of parameter values, generated once per kernel (a
    loop over per-argument rules costs more than the launch). ``access(i)``: the expression
    of argument ``i`` (``a[i]``, or a replay's fresh tensor or constant); ``constants``: the
    names those expressions use besides ``a``. A descriptor's expression may also be a
    fresh tensor whose descriptor fields are ``constants[f"t{i}"]``."""
    lines, values, n_desc = [], [], 0
    for i, kind in kinds:
        if kind == "ptr":
            values.append(f"{access(i)}.data_ptr()")
        elif kind == "desc":
            if f"t{i}" in constants:        # a replay's fresh tensor, the fields fixed
                lines.append(f"d{i} = _descriptor_at({access(i)}.data_ptr(), *t{i}, _meta[{n_desc}])")
            else:
                lines.append(f"d{i} = _descriptor({access(i)}, _meta[{n_desc}])")
            values.append(f"*d{i}")
            n_desc += 1
        else:
            values.append(access(i))
    values += ["0", "0"]
    body = "".join(f"    {line}\n" for line in lines)
    text = f"def pack(a):\n{body}    return ({', '.join(values)},)\n"
    scope = {"_descriptor": _descriptor, "_descriptor_at": _descriptor_at, "_meta": metas, **constants}
    exec(_packer_code(text), scope)
    return scope["pack"]


@functools.lru_cache(maxsize=256)
def _packer_code(text: str):
    """The compiled code of a packer's text: a replay of a launch like an earlier one (a new
    block mask each step: the same kernel, other addresses) has the same text, and compiling
    it took ~0.3 ms of a step's host time on the H100's host (its constants differ, and
    stay in the scope the code runs in)."""
    return compile(text, "<flexgen driver packer>", "exec")


def _current_context(device_index: int) -> None:
    """Make the device's primary context current on this thread (torch's context), as
    Triton's loader does, when no context is."""
    lib = _cuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def clear_memos() -> None:
    _ENCODED.clear()
    _BINDERS.clear()
    _packer_code.cache_clear()
