"""Sibling linears as one stacked packed product (qkv/stacked_linear.py).

Each slice must be exactly the stacked product's columns (bit-exact against oneDNN on the stacked weight), one
product must serve a whole group called on one input, a call on another input must compute its own, and nothing
may outlive the forward. Where oneDNN cannot pack bf16 weights (AVX2 only) the engine never takes this mode
(resolve_cpu_matmul), and the tests say so in the log.
"""

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu_linear import PackedLinear, linear_modes, onednn_available
from qkv.stacked_linear import StackedLinear


class Attn(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 96, bias=bias)
        self.k_proj = torch.nn.Linear(64, 32, bias=bias)
        self.v_proj = torch.nn.Linear(64, 32, bias=bias)
        self.o_proj = torch.nn.Linear(96, 64, bias=bias)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(64, 128, bias=False)
        self.up_proj = torch.nn.Linear(64, 128, bias=False)
        self.down_proj = torch.nn.Linear(128, 64, bias=False)


class Block(torch.nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.self_attn = Attn(bias)
        self.mlp = Mlp()
        self.odd = torch.nn.Module()  # q/k/v of different input widths: not a group
        self.odd.q_proj, self.odd.k_proj, self.odd.v_proj = (torch.nn.Linear(n, 8, bias=False) for n in (8, 8, 16))


def _block(bias: bool = False) -> Block:
    torch.manual_seed(0)
    return Block(bias).to(torch.bfloat16)


def _packing_or_log() -> bool:
    if onednn_available(torch.bfloat16):
        return True
    print("this CPU lacks the ISA oneDNN needs to pack bf16 weights (AVX-512 or AVX-NE-CONVERT): stacked mode not run")
    return False


def _stacked(x: torch.Tensor, *lins: torch.nn.Linear) -> list[torch.Tensor]:
    w = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in lins]), 16)
    b = None if lins[0].bias is None else torch.cat([m.bias.detach() for m in lins])
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, b, "none", [], "")
    return [s.reshape(*x.shape[:-1], -1) for s in y.split([m.out_features for m in lins], dim=-1)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_each_slice_is_the_stacked_products_columns(bias, rows):
    if not _packing_or_log():
        return
    blk = _block(bias)
    att = blk.self_attn
    x = torch.randn(2, rows, 64).to(torch.bfloat16)
    with StackedLinear(blk):
        got = [att.q_proj(x), att.k_proj(x), att.v_proj(x)]
        gate, up = blk.mlp.gate_proj(x), blk.mlp.up_proj(x)
    want = _stacked(x, att.q_proj, att.k_proj, att.v_proj)
    assert [tuple(t.shape) for t in got] == [(2, rows, 96), (2, rows, 32), (2, rows, 32)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip((gate, up), _stacked(x, blk.mlp.gate_proj, blk.mlp.up_proj)))
    # the same linear maps as F.linear's, to bf16 rounding
    for g, m in zip(got, (att.q_proj, att.k_proj, att.v_proj)):
        ref = F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float())
        torch.testing.assert_close(g.float(), ref, rtol=2e-2, atol=2e-2)


def test_one_product_serves_the_group_and_another_input_gets_its_own(monkeypatch):
    if not _packing_or_log():
        return
    blk = _block()
    att = blk.self_attn
    x, y = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with StackedLinear(blk) as st:
        group = next(f.args[0] for p, f in st.forwards if p is att.q_proj)
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0]) or real(*a))
        q = att.q_proj(x)
        assert group.input is x and [t is None for t in group.kept] == [True, False, False]
        k_other = att.k_proj(y)  # another input: its own stacked product, and the kept slices now follow y
        assert group.input is y and [t is None for t in group.kept] == [False, True, False]
        v_other = att.v_proj(y)  # taken from y's product
        assert group.input is y and [t is None for t in group.kept] == [False, True, True]
        q_y = att.q_proj(y)  # the last slice taken: nothing is left held
        assert group.input is None and group.kept == [None, None, None]
        k = att.k_proj(x)
        assert group.input is x and [t is None for t in group.kept] == [False, True, False]
        monkeypatch.undo()
        assert len(calls) == 3  # q on x, k on y (v took its slice), k on x again
    assert group.input is None and group.kept == [None, None, None]  # leaving drops what a model left untaken
    want_x, want_y = _stacked(x, att.q_proj, att.k_proj, att.v_proj), _stacked(y, att.q_proj, att.k_proj, att.v_proj)
    assert torch.equal(q, want_x[0]) and torch.equal(k, want_x[1])
    assert torch.equal(k_other, want_y[1]) and torch.equal(v_other, want_y[2]) and torch.equal(q_y, want_y[0])
    assert all("forward" not in m.__dict__ for m in blk.modules())  # restored on exit


def test_groups_by_name_and_width_and_packed_linears_take_the_rest():
    if not _packing_or_log():
        return
    blk = _block()
    st = StackedLinear(blk)
    att, mlp = blk.self_attn, blk.mlp
    assert st.linears == {id(m) for m in (att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj)}
    stacked, packed = (make() for make in linear_modes(blk, "packed", batch_invariant=False))
    assert isinstance(stacked, StackedLinear) and isinstance(packed, PackedLinear)
    odd = blk.odd
    assert [m for m, _, _ in packed.linears] == [att.o_proj, mlp.down_proj, odd.q_proj, odd.k_proj, odd.v_proj]
