"""Read the arrays of an `.npz` trace archive or of one `.npy` file without trusting the file.

Data flow:
    .npz file --zipfile--> member NAME.npy --.npy header: dtype, shape--> checked against the
        bytes the member really stores --> numpy array (no pickle)     (read_npz)
    .npy file --same header check against the file's size--> numpy array  (read_npy)

np.load is not used: it falls back to pickle for a file that is neither an archive nor an array
(its error then tells the user to pass allow_pickle=True), and it sizes its output array from the
.npy header before reading any data, so a damaged header asks for any amount of memory. Here an
array is allocated only after its declared size (shape x itemsize) fits the bytes stored for it,
object dtypes are refused from the header, and every failure is a TraceError that names the file
(and member) and says how to write a valid one.
"""

from __future__ import annotations

import math
import tokenize
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from sim.errors import TraceError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
# Deflate cannot expand data more than about 1032:1 (a 258-byte match costs at least 2 bits), so
# a deflated member that claims more than this many bytes per stored byte has a damaged size.
MAX_DEFLATE_RATIO = 1032
_HOW = ("write it with sim.trace.save_trace(trace, path) (np.savez_compressed of experts, meta "
        "and the optional arrays)")
# What zipfile, zlib and numpy's header parser (ast, and tokenize for 1.0 headers) raise for
# damaged bytes.
_DAMAGED = (ValueError, TypeError, EOFError, OSError, SyntaxError, tokenize.TokenError,
            zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError)


def _why(e: BaseException) -> str:
    """A short cause for a _DAMAGED error, without the library's own advice."""
    if isinstance(e, zlib.error):
        return "its compressed data does not decompress"
    if isinstance(e, zipfile.BadZipFile):
        return "bad zip data or checksum"
    if isinstance(e, EOFError):
        return "its data ends early"
    if isinstance(e, (NotImplementedError, RuntimeError)):
        return "compressed or encrypted in a way numpy never writes"
    return "bad .npy header or data"


def _read_header(fp: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy stream `fp`, left just after the header."""
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fp)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fp)
    raise ValueError(f".npy format version {version[0]}.{version[1]} is not read here")


def _read_array(fp: BinaryIO, stored: int, where: str, how: str) -> np.ndarray:
    """The array of the .npy stream `fp` holding `stored` bytes in all. Raises TraceError (ending
    in `how`, the way to write a valid file) when the header asks for an object dtype or for more
    bytes than are stored; ValueError (and the other _DAMAGED errors) for damaged bytes."""
    start = fp.tell()
    shape, _, dtype = _read_header(fp)
    if dtype.hasobject:
        raise TraceError(f"{where} holds a Python object array (dtype {dtype}), which a trace "
                         f"never has: store plain numeric (or string) arrays; {how}")
    if dtype.itemsize == 0 or min(shape, default=1) < 0:
        raise ValueError(f"dtype {dtype} / shape {shape} holds no data")
    count = math.prod(shape)
    declared, have = count * dtype.itemsize, stored - fp.tell()
    if declared > have:
        raise TraceError(f"{where}: its header declares shape {shape} of {dtype} ({declared} "
                         f"bytes) but only {have} bytes follow: the file is truncated or "
                         f"damaged; {how}")
    fp.seek(start)  # numpy reads it now that its size is known to be backed by stored bytes
    return np.lib.format.read_array(fp, allow_pickle=False)


def _member_size(info: zipfile.ZipInfo, archive_bytes: int, where: str) -> int:
    """The uncompressed size of a member, refused when the archive cannot hold it (64 bytes of
    slack cover deflate's own framing of tiny members)."""
    ratio = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: MAX_DEFLATE_RATIO}.get(info.compress_type)
    if info.compress_size > archive_bytes or (
            ratio is not None and info.file_size > ratio * info.compress_size + 64):
        raise TraceError(f"{where}: the zip directory gives it {info.file_size} bytes from "
                         f"{info.compress_size} stored, more than the archive can hold: the "
                         f"file is damaged; {_HOW}")
    return info.file_size


def read_npz(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The members `names` (stored as NAME.npy, or NAME) present in the archive at `path`.

    Members with other names are not read. Cost: one pass over the members read. Raises
    TraceError naming the file (and member) for a file that is not a zip archive, a bare .npy
    array, and a damaged, truncated or object-array member.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
            if head.startswith(NPY_MAGIC):
                raise TraceError(f"{path}: holds a single .npy array, not an .npz archive: store "
                                 f"experts and meta together; {_HOW}")
            f.seek(0, 2)
            archive_bytes = f.tell()
            f.seek(0)
            return _read_members(zipfile.ZipFile(f), path, archive_bytes, names)
    except TraceError:
        raise
    except PermissionError as e:
        raise TraceError(f"{path}: cannot be read ({e.strerror}): check its permissions") from None
    except _DAMAGED as e:
        what = ("not an .npz (zip) file" if isinstance(e, zipfile.BadZipFile)
                else f"its zip structure is damaged ({_why(e)})")
        raise TraceError(f"{path}: not a valid expertcache trace archive: {what}; "
                         f"{_HOW}") from None


def _read_members(z: zipfile.ZipFile, path: Path, archive_bytes: int,
                  names: tuple[str, ...]) -> dict[str, np.ndarray]:
    infos = {i.filename: i for i in z.infolist()}
    out: dict[str, np.ndarray] = {}
    for name in names:
        info = infos.get(f"{name}.npy", infos.get(name))
        if info is None:
            continue
        where = f"{path}: member '{info.filename}'"
        try:
            size = _member_size(info, archive_bytes, where)
            with z.open(info) as fp:
                if fp.read(len(NPY_MAGIC)) != NPY_MAGIC:
                    raise TraceError(f"{where} is not a .npy array: the archive is not an "
                                     f"expertcache trace; {_HOW}")
                fp.seek(0)
                out[name] = _read_array(fp, size, where, _HOW)
        except TraceError:
            raise
        except _DAMAGED as e:
            raise TraceError(f"{where} is damaged or truncated ({_why(e)}), so this is not a "
                             f"valid expertcache trace archive; {_HOW}") from None
    return out


def read_npy(path: Path, how: str) -> np.ndarray:
    """The array of the single .npy file at `path`; `how` says how to write a valid one.

    Raises TraceError naming the file for an .npz archive, a damaged or truncated file and an
    object array.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
            if head.startswith(ZIP_MAGIC):
                raise TraceError(f"{path}: is an .npz archive, not a .npy array: {how}")
            if head != NPY_MAGIC:
                raise TraceError(f"{path}: not a .npy array (no .npy header): {how}")
            f.seek(0, 2)
            size = f.tell()
            f.seek(0)
            return _read_array(f, size, str(path), how)
    except TraceError:
        raise
    except PermissionError as e:
        raise TraceError(f"{path}: cannot be read ({e.strerror}): check its permissions") from None
    except _DAMAGED as e:
        raise TraceError(f"{path}: damaged or truncated .npy file ({_why(e)}): {how}") from None
