"""Atomic operations on integer array elements for numba kernels that share memory between threads.

    load_acquire(a, i)               a[i], later reads see what the writer released before it
    store_release(a, i, v)           a[i] = v, what this thread wrote before is seen first
    fetch_add(a, i, v)               a[i] += v atomically (acquire and release); returns the old value
    compare_exchange(a, i, old, new) a[i] = new if a[i] == old, atomically (acquire and release); returns
                                     the value found (== old: it was stored)
    cpu_relax()                      a spin-wait hint (x86 `pause`; nothing elsewhere)
    monotonic_ns()                   the monotonic clock in ns (clock_gettime(CLOCK_MONOTONIC), the clock
                                     of Python's time.perf_counter_ns on Linux)

a: a C-contiguous int32 or int64 numpy array (the operation is on its element type); i: an index (not
wrapped, not bounds-checked); v, old, new: integers, converted to the element type. They are LLVM atomic
instructions, so they order memory between threads of one process and, on a mapped pinned buffer, with
a GPU kernel's system-scope operations (moe.engine.handoff).
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element(context, builder, signature, args):
    """(pointer to a[i], the element's LLVM type, its byte width) of an intrinsic's (a, i) arguments."""
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
    ty = context.get_value_type(aryty.dtype)
    return ptr, ty, ty.width // 8


def _as(builder, value, ty: ir.IntType):
    """An integer value as LLVM int `ty` (truncated or sign-extended)."""
    if value.type.width > ty.width:
        return builder.trunc(value, ty)
    if value.type.width < ty.width:
        return builder.sext(value, ty)
    return value


def _check(arr) -> None:
    if not isinstance(arr, types.Array) or arr.dtype not in (types.int32, types.int64):
        raise TypeError(f"cpu_atomics: the array must be int32 or int64, got {arr}")


@intrinsic
def load_acquire(typingctx, arr, i):
    _check(arr)

    def codegen(context, builder, signature, args):
        ptr, _, width = _element(context, builder, signature, args)
        return builder.load_atomic(ptr, "acquire", width)
    return arr.dtype(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, v):
    _check(arr)

    def codegen(context, builder, signature, args):
        ptr, ty, width = _element(context, builder, signature, args)
        builder.store_atomic(_as(builder, args[2], ty), ptr, "release", width)
        return context.get_dummy_value()
    return types.void(arr, i, v), codegen


@intrinsic
def fetch_add(typingctx, arr, i, v):
    _check(arr)

    def codegen(context, builder, signature, args):
        ptr, ty, _ = _element(context, builder, signature, args)
        return builder.atomic_rmw("add", ptr, _as(builder, args[2], ty), "acq_rel")
    return arr.dtype(arr, i, v), codegen


@intrinsic
def compare_exchange(typingctx, arr, i, old, new):
    _check(arr)

    def codegen(context, builder, signature, args):
        ptr, ty, _ = _element(context, builder, signature, args)
        pair = builder.cmpxchg(ptr, _as(builder, args[2], ty), _as(builder, args[3], ty), "acq_rel", "acquire")
        return builder.extract_value(pair, 0)
    return arr.dtype(arr, i, old, new), codegen


@intrinsic
def cpu_relax(typingctx):
    def codegen(context, builder, signature, args):
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()
    return types.void(), codegen


_CLOCK_MONOTONIC = 1  # Linux's clockid


@intrinsic
def monotonic_ns(typingctx):
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        spec = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))  # struct timespec {tv_sec; tv_nsec}
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [
            ir.IntType(32), i64.as_pointer()]), "clock_gettime")
        builder.call(fn, [ir.Constant(ir.IntType(32), _CLOCK_MONOTONIC), builder.bitcast(spec, i64.as_pointer())])
        sec = builder.load(builder.gep(spec, [ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 0)]))
        nsec = builder.load(builder.gep(spec, [ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 1)]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)
    return types.int64(), codegen
