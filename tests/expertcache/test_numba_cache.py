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
