"""Where a Triton kernel of the MoE layer runs, and its ahead-of-time compile for a CUDA target.

    @triton.jit kernel, tensor device ──kernel_for──► JITFunction (CUDA) or InterpretedFunction (CPU
                                                      under TRITON_INTERPRET=1), built once per mode
    @triton.jit kernel, arg types, constexprs ──compile_for_sm──► Triton's asm dict (ttir .. cubin)
    a cubin ──sass / sass_registers──► its SASS instructions, its registers a thread (cuobjdump)

Triton fixes the mode at decoration time; `kernel_for` builds the other mode's twin from the same
source, as expertcache.copy does, so one module serves GPU runs and CPU tests. Shared by
moe.kernels.routed, moe.kernels.router and moe.kernels.delta_rule (no forked copy of this logic per kernel module).
"""

from __future__ import annotations

import os
import re

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_TWINS: dict[tuple[str, str, str], object] = {}


def kernel_for(kernel, device, jit_options: dict, who: str):
    """`kernel` compiled for a CUDA device, interpreted for CPU tensors (TRITON_INTERPRET=1).

    jit_options: the decorator's options (do_not_specialize), reused for the twin. who: the
    public function named in the error. Raises RuntimeError for CPU tensors without the interpreter.
    """
    if device.type == "cuda":
        cls = JITFunction
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        cls = InterpretedFunction
    else:
        raise RuntimeError(f"{who} runs Triton kernels on CUDA tensors; for CPU tensors set "
                           "TRITON_INTERPRET=1 (Triton's interpreter) before importing triton")
    if isinstance(kernel, cls):
        return kernel
    key = (kernel.fn.__module__, kernel.fn.__name__, cls.__name__)
    if key not in _TWINS:
        _TWINS[key] = cls(kernel.fn, **jit_options)
    return _TWINS[key]


def _type_leaves(types, at=()):
    """(argument path, type string) of every leaf of a (nested) tuple of type strings."""
    for n, ty in enumerate(types):
        yield from _type_leaves(ty, at + (n,)) if isinstance(ty, tuple) else [(at + (n,), ty)]


def compile_for_sm(kernel, types: tuple[str, ...], constexprs: dict, warps: int, arch: int,
                   jit_options: dict, divisible: tuple[str, ...] = ()) -> dict:
    """Compile one kernel for CUDA sm_<arch> without a GPU (needs ptxas); returns its asm dict.

    types: Triton's type string of each runtime argument in order ("*bf16", "*fp32", "i32", ...), a
    tuple of them for a tuple argument; pointers are declared 16-byte aligned. divisible: the integer
    arguments declared multiples of 16, as the launcher specializes them when they are. constexprs:
    every constexpr argument's value. Run it in a process without TRITON_INTERPRET=1 (the interpreter
    replaces the compiler's language hooks).
    """
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(kernel.fn, **jit_options)
    # Every constexpr with a default is passed explicitly: Triton's cache key joins the constexprs'
    # values without their names, so leaving a different default out in two calls could make their
    # keys equal (GDC=True alone and PRE=True alone did) and return the other variant's binary.
    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    signature = {**dict(zip(fn.arg_names, types)), **{c: "constexpr" for c in constexprs}}
    aligned = {path: [["tt.divisibility", 16]] for path, ty in _type_leaves(types)
               if ty.startswith("*") or (len(path) == 1 and fn.arg_names[path[0]] in divisible)}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction of the one kernel in `cubin` (Triton's cuobjdump
    -sass; on sm_90 each is 16 bytes of code)."""
    return [(int(m.group(1), 16), m.group(2).strip()) for line in _cuobjdump(cubin, "-sass").splitlines()
            if (m := _SASS_LINE.match(line))]


def sass_registers(cubin: bytes) -> int | None:
    """Registers a thread of the kernel in `cubin` holds (cuobjdump -res-usage), None if not reported."""
    m = re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage"))
    return int(m.group(1)) if m else None
