"""Running statistics of one cached tensor (K or V of one layer), per kv head, in bounded memory.

Every observer works from these, so the K/V are seen once however the scale is
chosen afterwards:

* ``amax`` -- the exact running absmax per head (fp32), and ``amax_channel`` per
  (head, channel) for qkv's per-channel strategy;
* ``hist`` -- a histogram of ``|x|`` per head, 256 bins per octave from 2^-24 to
  2^24 (bins 0.2-0.4 % wide relative to their value; smaller values share an
  underflow bin, larger ones the top bin); it gives percentiles and clip rates;
* a reservoir (only when asked for): a uniform random sample of ``|x|`` per head
  (bottom-k random keys from a seeded generator), for the MSE search.

Symmetric quantization treats ``x`` and ``-x`` alike, so only ``|x|`` is kept.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["TensorStats", "single_thread", "LOG2_MIN", "LOG2_MAX", "BINS_PER_OCTAVE", "NUM_BINS", "bin_edges"]

LOG2_MIN = -24
LOG2_MAX = 24
BINS_PER_OCTAVE = 256
NUM_BINS = (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE + 1  # + the underflow bin 0
_BITS_OFFSET = (127 + LOG2_MIN) * BINS_PER_OCTAVE - 1  # fp32 (exponent, top 8 mantissa bits) -> bin


def bin_edges() -> torch.Tensor:
    """Edges of the bins, fp64 ``[NUM_BINS + 1]``: bin ``b`` holds ``edges[b] <= |x| < edges[b + 1]``.

    Bin 0 is ``[0, 2^-24)``; then each octave ``[2^e, 2^(e+1))`` splits into 256 equal
    bins (the fp32 exponent and the top 8 mantissa bits); the top bin is open-ended.
    """
    j = torch.arange(NUM_BINS, dtype=torch.float64)
    octave, step = torch.div(j, BINS_PER_OCTAVE, rounding_mode="floor"), j % BINS_PER_OCTAVE
    lower = torch.exp2(LOG2_MIN + octave) * (1 + step / BINS_PER_OCTAVE)
    return torch.cat([torch.zeros(1, dtype=torch.float64), lower])


_EDGES = bin_edges()


@contextlib.contextmanager
def single_thread():
    """Run many small tensor ops on one thread: on CPU that is far faster than splitting each of them
    over an intra-op pool (much more so on a busy machine); the model keeps its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _bin_index(a: torch.Tensor) -> torch.Tensor:
    """Bin of each ``|x|`` value (fp32, >= 0), read straight off its bit pattern."""
    idx = (a.view(torch.int32) >> (23 - 8)) - _BITS_OFFSET
    return idx.clamp_(0, NUM_BINS - 1)


class TensorStats:
    """Statistics of ``[T, H, D]`` tensors fed through :meth:`update`."""

    def __init__(self, num_heads: int, reservoir: int = 0, seed: int = 0) -> None:
        self.num_heads = num_heads
        self.amax = torch.zeros(num_heads, dtype=torch.float32)
        self.amax_channel: torch.Tensor | None = None  # [H, D], sized by the first update
        self.hist = torch.zeros(num_heads, NUM_BINS, dtype=torch.int64)
        self.count = 0  # elements seen per head
        self.reservoir_size = reservoir
        self._buf_keys: list[torch.Tensor] = []
        self._buf_vals: list[torch.Tensor] = []  # [H, n] |x| pieces
        self._buffered = 0
        self._kth: torch.Tensor | None = None
        self._gen = torch.Generator().manual_seed(seed) if reservoir else None

    def update(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[1] != self.num_heads:
            raise ValueError(f"expected a [T, {self.num_heads}, D] tensor, got {tuple(x.shape)}")
        ax = x.detach().to("cpu", torch.float32).abs()
        a = ax.transpose(0, 1).reshape(self.num_heads, -1)
        if not bool(torch.isfinite(a).all()):
            raise ValueError("observed K/V contain inf or NaN: the model overflows in this dtype (try --dtype float32)")
        self.amax = torch.maximum(self.amax, a.amax(dim=1))
        ch = ax.amax(dim=0) if ax.shape[0] else torch.zeros(ax.shape[1:])
        self.amax_channel = ch if self.amax_channel is None else torch.maximum(self.amax_channel, ch)
        self.count += a.shape[1]
        offs = torch.arange(self.num_heads).unsqueeze(1) * NUM_BINS
        flat = (_bin_index(a) + offs).reshape(-1)
        self.hist += torch.bincount(flat, minlength=self.num_heads * NUM_BINS).view(self.num_heads, NUM_BINS)
        if self.reservoir_size:
            self._reservoir_add(a)

    def _reservoir_add(self, a: torch.Tensor) -> None:
        # One random key per (token, dim) position, shared by the heads: every head's sample is
        # uniform and the heads stay aligned. Keys above the current k-th smallest can never enter,
        # so they are dropped before anything is concatenated; a top-k runs only when the buffer
        # has doubled.
        keys = torch.rand(a.shape[1], generator=self._gen)
        if self._kth is not None:
            keep = keys < self._kth
            keys, a = keys[keep], a[:, keep]
        self._buf_keys.append(keys)
        self._buf_vals.append(a)
        self._buffered += keys.numel()
        if self._buffered > 2 * self.reservoir_size:
            self._compact()

    def _compact(self) -> None:
        if not self._buf_keys:
            return
        keys, vals = torch.cat(self._buf_keys), torch.cat(self._buf_vals, dim=1)
        if keys.numel() > self.reservoir_size:
            keys, idx = keys.topk(self.reservoir_size, largest=False, sorted=False)
            vals = vals[:, idx]
            self._kth = keys.max()
        self._buf_keys, self._buf_vals, self._buffered = [keys], [vals], keys.numel()

    # -- queries -------------------------------------------------------------
    def _hist(self, per_head: bool) -> torch.Tensor:
        return self.hist if per_head else self.hist.sum(0, keepdim=True)

    def absmax(self, per_head: bool) -> torch.Tensor:
        """``[H]`` per head, ``[1]`` over the whole tensor."""
        return self.amax.clone() if per_head else self.amax.max().reshape(1)

    def channel_absmax(self) -> torch.Tensor:
        """``[H, D]``: the absmax of every channel of every head."""
        if self.amax_channel is None:
            raise ValueError("no values observed")
        return self.amax_channel.clone()

    def quantile(self, q: float, per_head: bool) -> torch.Tensor:
        """Smallest ``t`` with a fraction ``q`` of ``|x|`` at or below it (interpolated within its bin)."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        amax = self.absmax(per_head).double()
        if q == 1.0 or self.count == 0:
            return amax.float()
        hist = self._hist(per_head).double()
        cum = hist.cumsum(dim=1)
        target = q * cum[:, -1:]
        b = torch.searchsorted(cum, target).clamp(max=NUM_BINS - 1)  # first bin with cum >= target
        before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
        frac = ((target - before) / hist.gather(1, b).clamp(min=1)).clamp(0, 1).squeeze(1)
        b = b.squeeze(1)
        lo, hi = _EDGES[b], torch.minimum(_EDGES[b + 1], amax)
        t = lo + frac * (hi - lo).clamp(min=0)
        return torch.minimum(t, amax).float()

    def clip_rate(self, threshold: torch.Tensor) -> float:
        """Fraction of all observed values with ``|x| > threshold`` (``[H]`` or ``[1]``), from the histogram.

        Exactly 0 when the threshold is at or above the absmax; otherwise the bin
        holding the threshold counts in proportion (values uniform within a bin).
        """
        if self.count == 0:
            return 0.0
        th = threshold.double().reshape(-1).expand(self.num_heads)
        above = 0.0
        for h in range(self.num_heads):
            t = float(th[h])
            if t >= float(self.amax[h]):
                continue
            b = min(
                int(torch.searchsorted(_EDGES, torch.tensor([t], dtype=torch.float64), right=True)) - 1, NUM_BINS - 1
            )
            hi = min(float(_EDGES[b + 1]), float(self.amax[h]))
            lo = float(_EDGES[b])
            pos = min(max((t - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 1.0
            counts = self.hist[h]
            above += float(counts[b + 1 :].sum()) + float(counts[b]) * (1.0 - pos)
        return above / (self.count * self.num_heads)

    def reservoir(self, per_head: bool) -> torch.Tensor:
        """The sample as ``[N, H, 1]`` (per head) or ``[N*H, 1, 1]`` (whole tensor), ready for quantize()."""
        if not self.reservoir_size:
            raise ValueError("no reservoir was kept for these statistics (pass reservoir=... )")
        self._compact()
        sample = self._buf_vals[0] if self._buf_vals else torch.zeros(self.num_heads, 0)
        if per_head:
            return sample.t().unsqueeze(-1)
        return sample.reshape(-1, 1, 1)
