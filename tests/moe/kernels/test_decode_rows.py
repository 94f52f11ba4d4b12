"""The packed formats' group decode kernel (moe.kernels.decode_rows) against their torch decode, bit for bit.

Every code of a byte occurs (random bytes, not only quantized values), scales come from quantizing random
weights (valid by construction) or, for mxfp4, every exponent but NaN's. CPU runs use Triton's interpreter.
"""

import zlib

import pytest
import torch

from expertcache.formats import dense_format, get_format
from expertcache.formats.int4 import INT4
from moe.kernels.decode_rows import decode_slots, dequantize_rows_fast
from moe.model.slot_matrix import SlotMatrix, dequantize_rows
from tests.conftest import device_or_skip

FORMATS = {"int4": INT4(), "int4-f16-z": INT4(scale_dtype="float16", zero_points=True),
           "nvfp4": get_format("nvfp4"), "mxfp4": get_format("mxfp4"),
           **{dtype: dense_format(dtype) for dtype in ("bfloat16", "float16", "float32")}}


def random_parts(fmt, g: int, out_features: int, in_features: int, stack: int, seed: int) -> dict[str, torch.Tensor]:
    """Parts [G, *layout] of G matrices: quantized random weights, then every byte of q redrawn at random
    (and mxfp4's exponents, int4's zero points), so each code and sign occurs."""
    gen = torch.Generator().manual_seed(seed)
    if fmt.dense:  # the values themselves, signed zeros among them
        w = torch.randn(g, out_features, in_features, generator=gen) * 3
        w[:, 0, :2] = torch.tensor([0.0, -0.0])
        return {"": w.to(getattr(torch, fmt.dtype))}
    mats = [fmt.quantize(torch.randn(out_features, in_features, generator=gen) * 3, stack) for _ in range(g)]
    parts = {k: torch.stack([m[k] for m in mats]) for k in mats[0]}
    parts["q"] = torch.randint(0, 256, parts["q"].shape, dtype=torch.uint8, generator=gen)
    if fmt.name == "mxfp4":  # every exponent but NaN's; 0 (2^-127, subnormal), 1 and 254 at the first blocks
        parts["s"] = torch.randint(0, 255, parts["s"].shape, dtype=torch.uint8, generator=gen)
        parts["s"].view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    if "z" in parts:
        parts["z"] = torch.randint(0, 16, parts["z"].shape, dtype=torch.uint8, generator=gen)
    return parts


def decode_stacked(parts: dict[str, torch.Tensor], fmt, out_features: int, in_features: int,
                   stack: int) -> torch.Tensor:
    """The kernel's decode of G stacked matrices (parts [G, *layout shape]): one source, slots 0..G-1."""
    layout = fmt.layout(out_features, in_features, stack)
    g = parts[layout[0].suffix].shape[0]
    table = torch.stack([torch.zeros(g, dtype=torch.int32), torch.arange(g, dtype=torch.int32)], dim=1)
    matrix = SlotMatrix(fmt, tuple(parts[p.suffix] for p in layout), out_features, in_features, stack)
    return decode_slots([matrix], table.to(matrix.device))


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(3, 48, 256, 2), (2, 40, 96, 1), (1, 16, 416, 1)])
def test_the_kernel_decodes_as_the_format_does_bit_for_bit(name, shape):
    """G matrices of OUT x IN in STACK sub-matrices (nvfp4: a global scale each), IN a whole number of
    128-groups, fewer than one (96) and a partial last one (416): the kernel's float32 values, signed
    zeros included, are the torch decode's."""
    device, _ = device_or_skip()
    fmt = FORMATS[name]
    g, out_features, in_features, stack = shape
    parts = random_parts(fmt, g, out_features, in_features, stack, seed=zlib.crc32(repr((name, shape)).encode()))
    want = fmt.decode_batch(parts, out_features, in_features, stack)
    got = decode_stacked({k: v.to(device) for k, v in parts.items()}, fmt, out_features, in_features, stack)
    assert same_bits(got.cpu(), want)


@pytest.mark.parametrize("name", ["int4-f16-z", "nvfp4", "mxfp4", "bfloat16"])
def test_the_kernel_reads_each_slot_from_its_own_source(name):
    """A table of (source, slot) over two matrices of different slot counts, slots repeated and out of
    order: each output matrix is the torch decode of the slot it names."""
    device, _ = device_or_skip()
    fmt = FORMATS[name]
    out_features, in_features, stack = 32, 160 if name.startswith("int4") else 64, 2
    a, b = (random_parts(fmt, n, out_features, in_features, stack, seed) for n, seed in ((5, 3), (3, 4)))
    table = torch.tensor([[1, 2], [0, 4], [0, 0], [1, 0], [0, 4]], dtype=torch.int32)
    layout = fmt.layout(out_features, in_features, stack)
    sources = [SlotMatrix(fmt, tuple(m[p.suffix].to(device) for p in layout), out_features, in_features, stack)
               for m in (a, b)]
    got = decode_slots(sources, table.to(device)).cpu()
    for i, (src, slot) in enumerate(table.tolist()):
        parts = {k: v[slot:slot + 1] for k, v in (a, b)[src].items()}
        assert same_bits(got[i:i + 1], fmt.decode_batch(parts, out_features, in_features, stack)), i


def test_dequantize_rows_fast_is_dequantize_rows_for_rows_of_several_matrices(monkeypatch):
    """Rows from two matrices of one format (a pool's and a ring's) decode as dequantize_rows does; on the
    CPU the torch decode runs, on CUDA (named without an index, as a caller may) the kernel."""
    import moe.kernels.decode_rows as dr

    device, on_gpu = device_or_skip()
    launches = []
    real = dr.decode_slots
    monkeypatch.setattr(dr, "decode_slots", lambda *a: launches.append(a[1].tolist()) or real(*a))
    fmt = FORMATS["nvfp4"]
    mats = []
    for seed in (1, 2):
        parts = random_parts(fmt, 4, 32, 64, 2, seed)
        layout = fmt.layout(32, 64, 2)
        mats.append(SlotMatrix(fmt, tuple(parts[p.suffix].to(device) for p in layout), 32, 64, stack=2))
    rows = [(mats[0], 3), (mats[1], 0), (mats[0], 1)]
    assert same_bits(dequantize_rows_fast(rows, device).cpu(), dequantize_rows(rows, "cpu"))
    assert launches == ([[[0, 3], [1, 0], [0, 1]]] if on_gpu else [])


@pytest.mark.gpu
def test_the_kernel_decodes_a_group_of_qwen3_30b_experts_on_the_gpu_bit_for_bit():
    """A prefill group at Qwen3-30B-A3B's shapes (gate_up [2 x 768, 2048], down [2048, 768]) on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name, fmt in FORMATS.items():
        for out_features, in_features, stack in ((1536, 2048, 2), (2048, 768, 1)):
            parts = random_parts(fmt, 8, out_features, in_features, stack, seed=7)
            want = fmt.decode_batch({k: v.cuda() for k, v in parts.items()}, out_features, in_features, stack)
            got = decode_stacked({k: v.cuda() for k, v in parts.items()}, fmt, out_features, in_features, stack)
            assert same_bits(got, want), name
