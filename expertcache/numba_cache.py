"""numba's on-disk kernel cache, kept consistent with the modules a cached kernel inlines, and the
vector width numba's LLVM compiles the kernels for.

numba revalidates a cached kernel by the timestamp of the file that defines it only. A kernel that
inlines functions of other modules (the replay's policy verbs, the CPU experts' format decoders) would
keep running the old code after one of those changes: `drop_stale_kernels` drops the file's cached
kernels whenever the source of those modules differs from what they were compiled with.

LLVM's tunings of Intel's AVX-512 server cores prefer 256-bit vectors (the `prefer-256-bit` feature),
so numba compiles the CPU expert kernels' lane loops to half the width the cores have there. On an
AVX-512 host `prefer_wide_vectors` (run when this module is imported, before any kernel compiles) gives
numba the host's features less that preference, unless NUMBA_CPU_NAME or NUMBA_CPU_FEATURES say
otherwise; on a host whose tuning already uses 512-bit vectors nothing changes but the cache key.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType


def drop_stale_kernels(path: str, deps: Iterable[ModuleType]) -> None:
    """Delete the cached kernels of the module at `path` (its __pycache__/<stem>.*.nbi / .nbc) when the source
    of `deps` changed since the last call, so numba compiles them again. Cost: hashing the deps' source
    once per import. With NUMBA_CACHE_DIR set, numba keeps its cache elsewhere and this does nothing; a
    read-only install (where numba cannot cache either) is left alone."""
    cache = Path(path).with_name("__pycache__")
    stem = Path(path).stem
    digest = hashlib.sha256(b"".join(inspect.getsource(m).encode() for m in deps)).hexdigest()
    stamp = cache / f"{stem}.kernel-deps.sha256"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for f in cache.glob(f"{stem}.*.nb[ic]"):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass


def prefer_wide_vectors() -> bool:
    """Let numba's LLVM use the host's 512-bit vectors (module docstring); True when it set the features.
    No effect once numba's CPU code generator exists (it reads the features when it is made)."""
    from numba.core import config

    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return False
    import llvmlite.binding as ll

    features = ll.get_host_cpu_features()
    if not features.get("avx512f"):
        return False
    config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"
    return True


prefer_wide_vectors()


def target_features() -> set[str]:
    """The CPU features numba compiles for (NUMBA_CPU_FEATURES, as prefer_wide_vectors set it or the
    user did, else the host's): names without their sign, those enabled."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    if config.CPU_NAME is not None:  # a named CPU's own features, which llvmlite does not list: assume none
        return set()
    import llvmlite.binding as ll

    return {name for name, on in ll.get_host_cpu_features().items() if on}
