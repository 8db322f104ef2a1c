"""Compile generated kernels ahead of time for a GPU the machine may not have.

``triton.compile`` with a ``GPUTarget`` runs the whole compiler (down to
cubin through the ptxas that ships with Triton) without a GPU, so a compile
error in a generated kernel shows up on a CPU-only machine too. The tests
record every launch (``flexgen.launch.RECORDED``) and compile each distinct
kernel here for Hopper (sm_90), specialized as Triton's JIT specializes that
launch on a GPU (``arg_types``): the kernel the GPU would compile, not a more
general one (the specialization changes the code: a `tl` backward kernel that
spills 268 bytes as the GPU compiles it spilled 2488 unspecialized).
"""
from __future__ import annotations

import contextlib
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime import compiler_key, driver, launch
from ..codegen import cache
from ..codegen.spec import gpu_fp32_dot_precision

HOPPER = GPUTarget("cuda", 90, 32)
try:        # Gluon kernels take Gluon's descriptors (which carry a shared-memory layout)
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    _DESCRIPTORS = (TensorDescriptor, GluonDescriptor)
except ImportError:
    GluonASTSource, _DESCRIPTORS = None, (TensorDescriptor,)

_TRITON_DTYPES = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.bool: "i1",
}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPES[value.dtype]
    if isinstance(value, _DESCRIPTORS):
        # What Triton's launcher binds a host descriptor as: "tensordesc<bf16[1, 1, 64, 128]>"
        # (its dtype and block shape; shape and strides stay runtime values).
        return mangle_type(value)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for kernel argument {value!r}")


def arg_types(spec, args, constexprs) -> tuple:
    """Per argument of one launch of ``spec``'s kernel, (Triton type, specialization) as Triton's
    JIT binds it on a GPU (``driver.specialization``): ("*bf16", "D") for a pointer taken as
    16-byte aligned, ("i32", "D") for a multiple of 16, ("constexpr", 1) for an int of 1,
    ("tensordesc<...>", None) for a host descriptor. All the compile reads of the arguments
    (``compile_signature``), so the check compiles the kernel the GPU compiles for this launch.
    Where this Triton's binder is not the one flexgen reproduces, the types alone (None: the
    kernel unspecialized). ``args`` may be a recorded launch's (``launch._recorded``)."""
    module = cache.load(spec, interpret=False)
    try:
        bound = driver.specialization(module, args, _gpu_constexprs(spec, module, constexprs), HOPPER)
    except driver.Unsupported:
        return tuple((_arg_type(a), None) for a in args)
    return tuple(bound[:len(args)])


def compile_launch(spec, args, constexprs, target=HOPPER):
    """Compile the kernel of ``spec`` for ``target`` as the GPU would for this launch."""
    return compile_signature(spec, arg_types(spec, args, constexprs), constexprs, target)


def _gpu_constexprs(spec, module, constexprs: dict) -> dict:
    """A recorded launch's constexprs as the GPU launches the kernel (``launch._mode_constexprs``;
    fp32 dots as the GPU plans them)."""
    names = module.KERNEL.arg_names
    if "DOT_UPCAST" in names:
        constexprs = dict(constexprs, DOT_UPCAST=False)   # the GPU path, not the interpreter's
    if constexprs.get("DOT_PRECISION") == "ieee" and spec.dtype == "float32":
        # fp32 dots as the GPU plans them (spec.dot_precision: "tf32x3" by default): a launch
        # recorded on the CPU says "ieee", which the GPU takes only by FLEXGEN_FP32_DOT=ieee
        # and which compiles 2-2.4x slower (unrolled FMA loops).
        constexprs = dict(constexprs, DOT_PRECISION=gpu_fp32_dot_precision())
    if "EXACT_SIGMOID" in names:
        # tanh.approx for half inputs, as the GPU runs it (launch._launch_once)
        constexprs = dict(constexprs, EXACT_SIGMOID=not cache.half_inputs(spec))
    return constexprs


def compile_signature(spec, types, constexprs, target=HOPPER):
    """Compile the kernel of ``spec`` for ``target`` with the arguments ``types`` (``arg_types``:
    types and Triton's specialization). Everything it takes is small and picklable, so another
    process can run it."""
    from triton.compiler import make_backend
    module = cache.load(spec, interpret=False)
    kernel = module.KERNEL
    names = kernel.arg_names
    constexprs = _gpu_constexprs(spec, module, constexprs)
    if len(types) + len(constexprs) != len(names):
        raise ValueError(f"{spec.kernel_name}: a launch recorded {len(types)} arguments and "
                         f"{len(constexprs)} constexprs, the kernel takes {len(names)}")
    # As Triton's JIT packs a bound launch (JITFunction._pack_args): the types, the ints of 1
    # as constants, the attributes (divisibility) parsed by the backend.
    backend = make_backend(target)
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(names):
        ty, attr = types[i] if i < len(types) else ("constexpr", constexprs[name])
        signature[name] = ty
        if ty == "constexpr":
            constants[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    gluon = getattr(kernel, "is_gluon", lambda: False)()
    source = (GluonASTSource if gluon else ASTSource)(fn=kernel, signature=signature,
                                                     constexprs=constants, attrs=attrs)
    compiler_key.install()
    return triton.compile(source, target=target, options=driver.compile_options(module))


def check_compiles(spec, types, constexprs) -> tuple:
    """``compile_signature`` for Hopper, reporting instead of raising: (None, or the error as
    text; CPU seconds taken, ptxas's included). A kernel the driver launcher would decline
    (``flexgen.runtime.driver.decline_reason``) is an error too. The test suite runs it in
    worker processes (tests/conftest.py): an exception object need not pickle, its text does."""
    start = _cpu_seconds()
    try:
        compiled = compile_signature(spec, types, constexprs)
        error = None if compiled.asm.get("cubin") else "ptxas produced no cubin"
        reason = None if error else driver.decline_reason(compiled, len(types))
        if reason is not None:
            error = f"flexgen's driver launcher would decline this kernel: {reason}"
    except Exception as exc:  # any compiler error is the answer, not a crash of the worker
        error = f"{type(exc).__name__}: {exc}"
    return error, _cpu_seconds() - start


def _cpu_seconds() -> float:
    """This process's CPU time and its finished children's (Triton runs ptxas as one)."""
    import resource     # POSIX only, as is Triton's compiler
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def recording():
    """Collect (spec, args, constexprs) of every launch inside the block."""
    previous = launch.RECORDED
    launch.RECORDED = []
    try:
        yield launch.RECORDED
    finally:
        launch.RECORDED = previous
