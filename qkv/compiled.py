"""The model forward compiled by ``torch.compile`` (inductor), with qkv's attention and oneDNN's linears opaque.

Why: an eager forward of a small model is many small passes. RMSNorm, RoPE, SwiGLU and the residual adds run as
separate ATen kernels, each reading and writing the activations, and every op of every layer pays Python's
module-call and dispatch cost. That is a large share of a prefill, and at batch-1 decode the Python alone
rivals the weight reads. vLLM compiles its model for this reason; so can qkv, with ``--compile-model``.

Two things stay outside inductor, as opaque custom ops with fake (shape-only) implementations:

* the paged attention of a layer (``qkv::paged_attention``): it writes the cache through the engine's back end
  and attends, so the cache bytes are those of the eager path, written by the same kernel. Its step metadata
  (block tables, slots, lengths) is not a graph input: the runner sets it for the forward with
  :func:`step_context`, so the graph neither guards on it nor recompiles when the batch changes;
* the linears (``qkv::onednn_linear``, and ``qkv::fp32_linear`` on CPUs without 16-bit matrix units): oneDNN's
  inner product on weights reordered once (:mod:`qkv.cpu_linear`), which inductor cannot lower itself. Being
  opaque, the latter can also branch on the row count the graph does not know: a one-token decode reads the
  16-bit weights (half the bytes) instead of their fp32 copies, through the same kernel as the eager path.

A third opaque op, ``qkv::materialize`` (a copy), only stops a fusion: the rotary embedding's cos and sin tables
pass through it, so that they are computed once per forward instead of inside every layer's rotation.

What inductor fuses is the elementwise work in between, so the compiled forward computes every rounding of the
model's dtype where it sees fit: a bf16 forward is not bit-identical to transformers' eager one (as vLLM's is
not), and the exactness guarantees stay with the eager path (the default). The token count is an unbacked
symbol, so every step, one-token decodes included, reuses one graph; inductor caches its output on disk, so a
later start compiles faster.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .small_linear import few_rows_linear

if TYPE_CHECKING:
    from .attention import StepContext

__all__ = [
    "CompiledModel",
    "current_step",
    "fp32_linear",
    "materialize",
    "ONEDNN_ROWS",
    "onednn_linear",
    "onednn_product",
    "paged_attention",
    "step_context",
]

logger = logging.getLogger("qkv")

_STEP: contextvars.ContextVar[StepContext] = contextvars.ContextVar("qkv_step")


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    """The step the compiled forward's attention ops read, for the duration of one forward."""
    token = _STEP.set(ctx)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step() -> StepContext:
    try:
        return _STEP.get()
    except LookupError:
        raise RuntimeError("qkv::paged_attention ran outside a step; run the model through qkv's runner") from None


# The two ops are declared on a plain ``torch.library.Library`` rather than with ``torch.library.custom_op``: the
# latter's Python wrapper (autograd registration, schema checks) costs a few microseconds a call, and a decode step
# makes one call per linear and per layer's attention, hundreds of them.
_LIB = torch.library.Library("qkv", "DEF")
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scaling) -> Tensor")
_LIB.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor")
_LIB.define("materialize(Tensor x) -> Tensor")
_LIB.define(
    "fp32_linear(Tensor x, Tensor weight32, Tensor? bias32, Tensor weight, Tensor? bias, int out_features,"
    " int min_rows) -> Tensor"
)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scaling: float) -> torch.Tensor:
    """``[T, H, D]`` queries and ``[T, Hkv, D]`` keys/values of layer ``layer_idx``: write, then attend."""
    return current_step().attend_layer(layer_idx, q, k, v, scaling).contiguous()


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``[N, in]`` times a weight reordered by ``torch.ops.mkldnn._reorder_linear_weight``: ``[N, out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _fp32_linear(
    x: torch.Tensor,
    weight32: torch.Tensor,
    bias32: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    min_rows: int,
) -> torch.Tensor:
    """``[N, in]`` 16-bit rows: fewer than ``min_rows`` times the model's own 16-bit weight through
    :mod:`qkv.small_linear` (a call that few rows is bound by reading the weight), otherwise their fp32 upcasts
    times the reordered fp32 copy, rounded back once (:class:`qkv.cpu_linear.Fp32Linear`, whose eager forward
    makes the same choice)."""
    if x.shape[0] < min_rows:
        return few_rows_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.float(), weight32, bias32, "none", [], "").to(x.dtype)


_LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
_LIB.impl("materialize", torch.clone, "CompositeExplicitAutograd")
_LIB.impl("fp32_linear", _fp32_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("qkv::paged_attention", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scaling: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("qkv::onednn_linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("qkv::fp32_linear", lib=_LIB)
def _(x: torch.Tensor, *weights_and_sizes: Any) -> torch.Tensor:  # weight32, bias32, weight, bias, out, min_rows
    return x.new_empty(x.shape[0], weights_and_sizes[4])


@torch.library.register_fake("qkv::materialize", lib=_LIB)
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


paged_attention = torch.ops.qkv.paged_attention.default
fp32_linear = torch.ops.qkv.fp32_linear.default
onednn_linear = torch.ops.qkv.onednn_linear.default
materialize = torch.ops.qkv.materialize.default
ONEDNN_ROWS = 16  # the row count oneDNN's weight layout is chosen for (measured: no slower at 1 or 2,048 rows)


def onednn_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``[N, in]`` times a weight reordered for ``ONEDNN_ROWS``: directly when eager, as the opaque op under
    torch.compile (the custom op's dispatch would cost eager decode a few percent)."""
    if torch.compiler.is_compiling():
        return onednn_linear(x, w, b, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _rope_once(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A rotary embedding's ``(cos, sin)``, each copied by an opaque op, so that inductor computes the table once
    per forward: left to itself it fuses ``cos(position x inv_freq)`` into every layer's rotation, and recomputes
    the cosine and sine for each head's element of q and k in every layer."""
    return tuple(materialize(t) for t in forward(*args, **kwargs))


class CompiledModel:
    """A causal LM's decoder under ``torch.compile`` (dynamic token count), called with the step's context set;
    the LM head runs eagerly on the rows that need logits, so the graph does not depend on how many do.

    :meth:`warm_up` compiles it before the first request, through a ``run(T)`` callback that makes one forward of
    ``T`` tokens; if inductor cannot build on this machine (no C++ compiler, an unsupported op), it warns once,
    :attr:`ok` turns false, and the runner stays eager.
    """

    # One graph serves every token count (the count is unbacked); a second shape checks that it does.
    WARM_UP_TOKENS = (4, 1)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        decoder: torch.nn.Module = model.get_decoder()  # type: ignore[operator]  # a transformers PreTrainedModel
        # size_asserts off: inductor would check every opaque op's output against its fake impl on every call
        # (hundreds a decode step); the fakes above declare exactly what the ops return, and the tests compare.
        self.decoder: Callable[..., Any] = torch.compile(decoder, dynamic=True, options={"size_asserts": False})
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        # installed only while the compiled decoder runs, as the linear modes' forwards are; made once per model and
        # kept on it, so that dynamo's guards on them hold from step to step and across the engines sharing the model
        # (a new function per engine would recompile the decoder for each)
        if "_qkv_rope_once" not in model.__dict__:
            model.__dict__["_qkv_rope_once"] = [
                (m, functools.partial(_rope_once, m.forward))
                for m in decoder.modules()
                if type(m).__name__.endswith("RotaryEmbedding")
            ]
        self.ropes: list[tuple[torch.nn.Module, Callable[..., Any]]] = model.__dict__["_qkv_rope_once"]
        self.ok = True
        self.seconds = 0.0

    def __call__(
        self, ctx: StepContext, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """``[1, T]`` ids and positions; logits ``[len(rows), vocab]`` of the hidden states at ``rows``."""
        # Unbacked: no specialization of one token, so that decode of one sequence shares the graph of the rest.
        for t in (input_ids, position_ids):
            torch._dynamo.decorators.mark_unbacked(t, 1)
        # Python floats (attention scaling, norm epsilons) as constants: tracing them as symbols and specializing
        # later makes dynamo restart its analysis, which costs a whole second trace of the model.
        for m, forward in self.ropes:
            m.__dict__["forward"] = forward
        try:
            with step_context(ctx), torch._dynamo.config.patch(specialize_float=True):
                hidden = self.decoder(
                    input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False
                ).last_hidden_state
        finally:
            for m, _ in self.ropes:
                m.__dict__.pop("forward", None)
        head: torch.nn.Module = self.model.get_output_embeddings()  # type: ignore[operator]
        logits = head(hidden[0, rows])
        if self.softcap is not None:  # as the model's own forward does (Gemma)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def warm_up(self, run: Callable[[int], None]) -> None:
        start = time.perf_counter()
        try:
            for tokens in self.WARM_UP_TOKENS:
                run(tokens)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler means: stay eager
            self.ok = False
            torch._dynamo.reset()
            text = str(e).strip()
            first = text.splitlines()[0] if text else type(e).__name__
            logger.warning("qkv: --compile-model: torch.compile failed on this machine (%s); running eagerly", first)
        self.seconds = time.perf_counter() - start
