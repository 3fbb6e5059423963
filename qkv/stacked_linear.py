"""Sibling linears that read the same input (q, k, v; gate, up) as one packed 16-bit product.

Why: where the CPU has 16-bit matrix units the linears run on oneDNN's inner product with packed weights
(:class:`qkv.cpu_linear.PackedLinear`), and one product on stacked weights beats several narrow ones. At decode's
few rows a call is bound by reading its weight and by its fixed cost, and oneDNN is inefficient on the narrow k
and v weights (``kv_heads x head_dim`` outputs: 192 for SmolLM2); at prefill's thousands of rows the stacked
gate and up product runs nearer the units' peak. Measured with 30 layers' weights coming from memory, as in a
step (``docs/benchmarks.md``): q, k and v stacked take about half the time of the three calls at 1 to 64 rows,
gate and up stacked 5-7 % less than the two calls at every row count.

transformers' blocks call ``q_proj``, ``k_proj`` and ``v_proj`` (or ``gate_proj`` and ``up_proj``) one after the
other on the same hidden states, each in a forward of its own that this module cannot change without rewriting
every model's attention and MLP. So the first of a group to be called computes the stacked product and keeps
the others' slices for that input tensor (by identity); the others take theirs, and the last to take one drops
the group's hold on it. A call on any other input (a model that projects something else) computes the stacked
product again and takes its own slice: slower, never wrong.

The slices are oneDNN's products summed in an order of its own, as the packed linears' are: a speed path, off
under ``--batch-invariant`` with them.
"""

from __future__ import annotations

import functools

import torch

from .compiled import ONEDNN_ROWS, onednn_product

__all__ = ["GROUPS", "StackedLinear"]

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # transformers' names for sibling linears


class _Group:
    """One block's stacked weight, and the slices of its last product not yet taken."""

    def __init__(self, parts: list[torch.nn.Linear]) -> None:
        stacked = torch.cat([p.weight.detach() for p in parts])
        self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, ONEDNN_ROWS)
        self.bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.sizes = [p.out_features for p in parts]
        self.out_features = sum(self.sizes)
        self.input: torch.Tensor | None = None  # the hidden states the kept slices belong to
        self.kept: list[torch.Tensor | None] = [None] * len(parts)

    def clear(self) -> None:
        self.input, self.kept = None, [None] * len(self.sizes)


def _stackable(m: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    parts = [getattr(m, name, None) for name in names]
    if not all(isinstance(p, torch.nn.Linear) for p in parts):
        return None
    lins: list[torch.nn.Linear] = parts  # type: ignore[assignment]
    same = len({(p.in_features, p.weight.dtype, p.bias is None) for p in lins}) == 1
    return lins if same and lins[0].weight.dtype in (torch.bfloat16, torch.float16) else None


class StackedLinear:
    """While entered, each group of :data:`GROUPS` in a block of ``model`` (16-bit linears of one input width, all
    with or all without bias) computes its outputs from one stacked packed product. The stacked copies are made
    once per model and kept on it, shared by the engines that share it, as the packed linears' copies are;
    :attr:`linears` lists the linears covered, which the packed linears then need not pack."""

    def __init__(self, model: torch.nn.Module) -> None:
        cached = model.__dict__.setdefault("_qkv_stacked_linears", {})
        if "forwards" not in cached:
            forwards: list[tuple[torch.nn.Linear, functools.partial]] = []
            for m in model.modules():
                for names in GROUPS:
                    parts = _stackable(m, names)
                    if parts is not None:
                        group = _Group(parts)
                        forwards += [(p, functools.partial(self._forward, group, i)) for i, p in enumerate(parts)]
            cached["forwards"] = forwards
            cached["groups"] = list({id(f.args[0]): f.args[0] for _, f in forwards}.values())
        self.forwards: list[tuple[torch.nn.Linear, functools.partial]] = cached["forwards"]
        self.groups: list[_Group] = cached["groups"]
        self.linears = {id(p) for p, _ in self.forwards}

    def __enter__(self) -> StackedLinear:
        for p, forward in self.forwards:
            p.__dict__["forward"] = forward  # an instance attribute, as the packed linears' forwards
        return self

    def __exit__(self, *exc) -> None:
        for p, _ in self.forwards:
            p.__dict__.pop("forward", None)
        for group in self.groups:
            group.clear()  # nothing is held past a forward, whatever the model called

    @staticmethod
    def _forward(group: _Group, part: int, x: torch.Tensor) -> torch.Tensor:
        kept = group.kept[part]
        if kept is not None and group.input is x:
            group.kept[part] = None
            if all(k is None for k in group.kept):
                group.input = None
            return kept
        out = onednn_product(x.reshape(-1, x.shape[-1]), group.weight, group.bias, group.out_features)
        slices = [s.reshape(*x.shape[:-1], s.shape[-1]) for s in out.split(group.sizes, dim=-1)]
        group.input, group.kept = x, [None if i == part else s for i, s in enumerate(slices)]
        return slices[part]
