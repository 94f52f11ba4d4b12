"""drop_stale_kernels: a kernel file's cached kernels are dropped exactly when a module they inline changes."""

import importlib.util
import linecache


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cached_kernels_are_dropped_when_a_dependency_changes(tmp_path):
    from expertcache.numba_cache import drop_stale_kernels

    dep = tmp_path / "dep.py"
    dep.write_text("A = 1\n")
    kernels = tmp_path / "kern.py"
    cached = [tmp_path / "__pycache__" / f"kern.f-1.py311.{ext}" for ext in ("nbi", "1.nbc")]
    other = tmp_path / "__pycache__" / "other.g-1.py311.nbi"  # another file's kernel: never touched

    def fill():
        for f in (*cached, other):
            f.parent.mkdir(exist_ok=True)
            f.write_text("")

    fill()
    drop_stale_kernels(str(kernels), [_load(dep)])  # no stamp yet: compiled with unknown deps
    assert not any(f.exists() for f in cached) and other.exists()
    fill()
    drop_stale_kernels(str(kernels), [_load(dep)])  # the same source: kept
    assert all(f.exists() for f in cached)
    dep.write_text("A = 2\n")
    linecache.checkcache(str(dep))
    drop_stale_kernels(str(kernels), [_load(dep)])
    assert not any(f.exists() for f in cached) and other.exists()


def _features_in_a_fresh_process(env: dict) -> str:
    import os
    import subprocess
    import sys

    code = ("import expertcache.numba_cache, numba.core.config as c; import llvmlite.binding as ll; "
            "print(c.CPU_FEATURES); print(bool(ll.get_host_cpu_features().get('avx512f')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}, **env})
    return out.stdout.split("\n")


def test_wide_vectors_on_an_avx512_host_unless_the_user_chose():
    features, avx512 = _features_in_a_fresh_process({})[:2]
    if avx512 == "True":
        assert features.endswith(",-prefer-256-bit") and "+avx512f" in features
    else:
        assert features == "None"
    chosen = _features_in_a_fresh_process({"NUMBA_CPU_NAME": "generic"})[0]
    assert "prefer-256-bit" not in chosen, "the user's NUMBA_CPU_NAME / NUMBA_CPU_FEATURES are left alone"
