"""Linear layers of a 16-bit model multiplied in fp32 on CPUs without 16-bit matrix instructions.

Why: on an x86 CPU without AVX512-BF16 or AMX, torch's bf16 (and fp16) GEMM converts
inside its inner loop and runs at a fraction of the fp32 GEMM's rate. Measured on this
project's 2-core AMD EPYC (AVX2): a ``[512, 576] x [576, 1536]`` linear takes 56 ms in
bf16 and 8 ms in fp32 (16 against 110 GFLOP/s). Every forward of a bf16 model is made
of such GEMMs, so prefill and batched decode run several times faster when each linear
multiplies the exact fp32 upcasts of its bf16 operands and rounds the result back to
bf16 once: what the bf16 kernel itself computes (an fp32 accumulation of exact products,
one rounding), in another summation order. Activations, norms, attention and the KV
cache stay in the model's dtype; only the GEMMs' insides change.

The fp32 GEMM is oneDNN's inner product on weights reordered once into its blocked layout
(``torch.ops.mkldnn``, what inductor's freezing pass uses), where this torch build has oneDNN,
and MKL's ``F.linear`` on a plain fp32 copy otherwise. MKL repacks the weights on every call,
and at decode's row counts that dominates: measured here at 16 rows, a ``[1536, 576]`` linear
takes 0.49 ms through MKL and 0.34 ms through oneDNN, the 49152-row LM head 45 ms and 15 ms;
at 512 rows they are within 5-25 %, oneDNN ahead.

A call with few rows is bound by reading the weights, not by arithmetic, and there an
fp32 copy (twice the bytes) is slower, and torch's own bf16 GEMM slower still (it widens the
weights in a loop that runs well below memory speed). Calls of fewer than :data:`MIN_ROWS`
rows therefore read the model's 16-bit weights through the C++ kernel of
:mod:`qkv.small_linear`, which computes what the bf16 GEMM computes in a fixed order of its own;
its register tiles keep it ahead of oneDNN's fp32 inner product up to about a hundred rows,
the whole range of a batched decode step, and prefill's longer calls take oneDNN.
Where the two ways cross depends on the CPU: ``scripts/bench_few_rows.py`` measures it
(``eval/results/bench/few_rows_*.json``).

:class:`Fp32Linear` swaps the linears' ``forward`` only while a forward runs, so the
model object stays shareable with another engine or with ``transformers`` code. Its
fp32 copies (one per distinct tensor) are built once per model and kept on it, so engines
sharing a model share them; they cost twice the linear weights' bf16 bytes in memory. Under
``--batch-invariant`` the few-row kernel takes every call (:class:`~qkv.small_linear.KernelLinear`): its
order of operations depends on K alone, so it is row-invariant without the fixed tiles' padding, which would
make a one-row decode step multiply 48 rows. Where the kernel cannot be built, the plain copies and
``F.linear`` are used, below the fixed-shape tiles.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .batch_invariant import BatchInvariantLinear
from .compiled import ONEDNN_ROWS as _ONEDNN_ROWS
from .compiled import fp32_linear, onednn_product
from .small_linear import KernelLinear, few_rows_kernel, few_rows_linear
from .stacked_linear import StackedLinear

__all__ = [
    "CPU_MATMUL_DTYPES",
    "Fp32Linear",
    "PackedLinear",
    "MIN_ROWS",
    "linear_modes",
    "native_16bit_matmul",
    "onednn_available",
    "resolve_cpu_matmul",
]

CPU_MATMUL_DTYPES = ("auto", "model", "float32")
MIN_ROWS = 128  # rows per call from which the fp32 GEMM wins (module docstring); fewer read the 16-bit weights


def native_16bit_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices in hardware (AVX512-BF16 or AMX) and oneDNN may use it.

    Both are asked: the CPU's flags, and oneDNN's own answer, which ``ONEDNN_MAX_CPU_ISA`` lowers (the exactness
    rerun caps it at AVX2, and then a bf16 weight reorder raises); such a process takes the AVX2 machines' path."""
    cpu, mkldnn = torch.cpu, torch.ops.mkldnn
    if dtype == torch.bfloat16:
        hw = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
        return bool(hw and mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(cpu._is_amx_fp16_supported() and mkldnn._is_mkldnn_fp16_supported())
    return True


def resolve_cpu_matmul(setting: str, model_dtype: torch.dtype, device: torch.device) -> str:
    """How a CPU engine's linears multiply: ``"float32"`` (exact fp32 upcasts, one rounding back), ``"packed"``
    (the model's 16-bit dtype through oneDNN's inner product on weights reordered once, where the CPU has
    16-bit matrix instructions and this torch build has oneDNN) or ``"model"`` (plain ``F.linear``, as
    transformers does). ``auto`` picks ``float32`` on CPUs without 16-bit matrix units and ``packed`` on the
    others; ``model`` and ``float32`` force theirs. Not a CPU or not a 16-bit model: ``"model"``."""
    if setting not in CPU_MATMUL_DTYPES:
        raise ValueError(f"cpu_matmul_dtype must be one of {', '.join(CPU_MATMUL_DTYPES)}, got {setting!r}")
    if device.type != "cpu" or model_dtype not in (torch.bfloat16, torch.float16) or setting == "model":
        return "model"
    if setting == "float32" or not native_16bit_matmul(model_dtype):
        return "float32"
    return "packed" if onednn_available(model_dtype) else "model"


_COPIES = "_qkv_fp32_linears"  # attribute of the model holding its linears' fp32 copies, by layout


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build can reorder a ``dtype`` weight for oneDNN's inner product and run it (asked, not
    assumed: the answer depends on the build, the CPU and ``ONEDNN_MAX_CPU_ISA``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), _ONEDNN_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(y.float(), torch.full((2, 8), 8.0)))


def _fp32_copies(
    model: torch.nn.Module, onednn: bool
) -> list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor | None]]:
    """(module, fp32 weight, fp32 bias) per 16-bit ``nn.Linear``; one copy per distinct tensor (tied weights).

    With ``onednn`` the weight copy is in oneDNN's blocked layout, for ``torch.ops.mkldnn._linear_pointwise``."""
    copies: dict[int, torch.Tensor] = {}  # id of a parameter the model holds -> its fp32 copy

    def fp32(t: torch.Tensor, weight: bool) -> torch.Tensor:
        if id(t) not in copies:
            c = t.detach().float()
            copies[id(t)] = torch.ops.mkldnn._reorder_linear_weight(c, _ONEDNN_ROWS) if onednn and weight else c
        return copies[id(t)]

    return [
        (m, fp32(m.weight, True), None if m.bias is None else fp32(m.bias, False))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dtype in (torch.bfloat16, torch.float16)
    ]


class Fp32Linear:
    """While entered, every ``nn.Linear`` of ``model`` with 16-bit weights computes, for an input of at least
    ``min_rows`` rows, ``F.linear(x.float(), w.float(), b.float()).to(x.dtype)`` from cached fp32 copies.

    Entering swaps each module's ``forward`` for the fp32 one and leaving restores it (a function mode
    would run Python for every op of the forward: 13 ms per decode step here). The copies are made once,
    one per distinct tensor, so tied weights are converted once. Under ``--batch-invariant`` pass
    ``min_rows=1``: the choice must not depend on the row count, and the fixed-shape tiles of
    :class:`~qkv.batch_invariant.BatchInvariantLinear` then apply to the fp32 call, and ``onednn=False``:
    those tiles intercept ``F.linear``. ``onednn=None`` takes oneDNN's packed inner product (the same
    formula, another summation order) where :func:`onednn_available` says this torch build has it.
    """

    def __init__(self, model: torch.nn.Module, min_rows: int = MIN_ROWS, onednn: bool | None = None) -> None:
        self.min_rows = min_rows
        self.onednn = onednn_available() if onednn is None else onednn
        # Kept on the model, so that engines sharing one model (qkv eval, qkv bench) share one set of copies.
        cached = model.__dict__.setdefault(_COPIES, {})
        if self.onednn not in cached:
            cached[self.onednn] = _fp32_copies(model, self.onednn)
        self.linears: list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor | None]] = cached[self.onednn]
        # Made once per model and kept with the copies, so that every forward of every engine sharing the model
        # sees the same functions: torch.compile's guards check them, and a new function would mean a recompile.
        key = ("forwards", self.onednn, min_rows)
        if key not in cached:
            cached[key] = [functools.partial(self._forward, min_rows, self.onednn, *lin) for lin in self.linears]
        self.forwards: list[Callable[[torch.Tensor], torch.Tensor]] = cached[key]

    def __enter__(self) -> Fp32Linear:
        for (m, _, _), forward in zip(self.linears, self.forwards):
            m.__dict__["forward"] = forward  # an instance attribute; Module.__setattr__ costs microseconds
        return self

    def __exit__(self, *exc) -> None:
        for m, _, _ in self.linears:
            m.__dict__.pop("forward", None)

    @staticmethod
    def _forward(
        min_rows: int, onednn: bool, m: torch.nn.Linear, w32: torch.Tensor, b32: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if onednn:  # the token count is a symbol without a value here: the opaque op takes the branch below
                rows = x.reshape(-1, x.shape[-1])
                y = fp32_linear(rows, w32, b32, m.weight, m.bias, m.out_features, min_rows)
                return y.reshape(*x.shape[:-1], m.out_features)
        elif x.numel() < min_rows * x.shape[-1]:
            return few_rows_linear(x, m.weight, m.bias)
        if not onednn:
            return F.linear(x.float(), w32, b32).to(x.dtype)
        y = onednn_product(x.reshape(-1, x.shape[-1]).float(), w32, b32, m.out_features)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class PackedLinear:
    """While entered, every 16-bit ``nn.Linear`` of ``model`` multiplies in its own dtype through oneDNN's inner
    product on a copy of its weight reordered once into oneDNN's blocked layout (AMX or AVX512-BF16 tiles).

    ``F.linear`` on a plain weight makes oneDNN (or MKL) reorder it on every call, which at decode's few rows
    costs more than the product. The copies (one per distinct tensor, kept on the model and shared by the
    engines that share it) cost the linear weights' bytes once more; the originals stay for the embedding
    lookup of tied weights and for other engines."""

    def __init__(self, model: torch.nn.Module, skip: frozenset[int] = frozenset()) -> None:
        """``skip``: ids of linears another mode runs (:class:`~qkv.stacked_linear.StackedLinear`'s), left unpacked; the
        same for every engine that shares the model, since the copies are made once."""
        cached = model.__dict__.setdefault(_COPIES, {})
        if "packed" not in cached:
            cached["packed"] = _packed_copies(model, skip)
        self.linears: list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor | None]] = cached["packed"]
        if "packed_forwards" not in cached:  # one set per model, as Fp32Linear's
            cached["packed_forwards"] = [
                functools.partial(self._forward, w, b, m.out_features) for m, w, b in self.linears
            ]
        self.forwards: list[Callable[[torch.Tensor], torch.Tensor]] = cached["packed_forwards"]

    def __enter__(self) -> PackedLinear:
        for (m, _, _), forward in zip(self.linears, self.forwards):
            m.__dict__["forward"] = forward  # an instance attribute; Module.__setattr__ costs microseconds
        return self

    def __exit__(self, *exc) -> None:
        for m, _, _ in self.linears:
            m.__dict__.pop("forward", None)

    @staticmethod
    def _forward(w: torch.Tensor, b: torch.Tensor | None, out_features: int, x: torch.Tensor) -> torch.Tensor:
        y = onednn_product(x.reshape(-1, x.shape[-1]), w, b, out_features)
        return y.reshape(*x.shape[:-1], out_features)


def _packed_copies(
    model: torch.nn.Module, skip: frozenset[int]
) -> list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor | None]]:
    copies: dict[int, torch.Tensor] = {}

    def packed(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = torch.ops.mkldnn._reorder_linear_weight(t.detach(), _ONEDNN_ROWS)
        return copies[id(t)]

    return [
        (m, packed(m.weight), None if m.bias is None else m.bias.detach())
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dtype in (torch.bfloat16, torch.float16) and id(m) not in skip
    ]


def linear_modes(
    model: torch.nn.Module, matmul: str, batch_invariant: bool
) -> list[Callable[[], contextlib.AbstractContextManager]]:
    """The runner's modes, in the order it enters them: how the linears multiply (``matmul``, see
    :func:`resolve_cpu_matmul`), then the fixed-shape tiles of ``--batch-invariant`` on top, so that every call
    is tiled before the fp32 mode sees it. The tiles intercept ``F.linear``, so under them the packed mode gives
    way to plain ``F.linear`` in the model's dtype. The fp32 mode, and an fp32 model's own GEMMs, give way to the
    few-row kernel at every row count, which needs no tiles (:class:`~qkv.small_linear.KernelLinear`); the tiles
    stay on top for any ``F.linear`` the kernel does not take. Without the kernel, the fp32 mode uses plain fp32
    copies under the tiles."""
    modes: list[Callable[[], contextlib.AbstractContextManager]] = []
    exact = _kernel_linears(model, matmul) if batch_invariant else None
    if exact is not None:
        mode: contextlib.AbstractContextManager = exact
        modes.append(lambda: mode)
    elif matmul == "float32":
        mode = Fp32Linear(model, min_rows=1 if batch_invariant else MIN_ROWS, onednn=False if batch_invariant else None)
        modes.append(lambda: mode)
    elif matmul == "packed" and not batch_invariant:
        stacked = StackedLinear(model)  # q/k/v and gate/up as one product each; the packed linears take the rest
        packed = PackedLinear(model, frozenset(stacked.linears))
        modes += [lambda: stacked, lambda: packed]
    if batch_invariant:
        modes.append(BatchInvariantLinear)
    return modes


def _kernel_linears(model: torch.nn.Module, matmul: str) -> KernelLinear | None:
    """``--batch-invariant``'s linears on the few-row kernel, where it computes their arithmetic: a 16-bit model's
    under the fp32 matmul (exact products, fp32 sums), an fp32 model's on a CPU. Row-invariant by its order of
    operations, it needs no fixed tiles to pad to. None where the kernel cannot be built or takes nothing."""
    dtypes = (torch.bfloat16, torch.float16) if matmul == "float32" else (torch.float32,) if matmul == "model" else ()
    linears = [
        m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype in dtypes and m.weight.is_cpu
    ]
    kernel = few_rows_kernel() if linears else None
    return None if kernel is None else KernelLinear(linears, kernel)
