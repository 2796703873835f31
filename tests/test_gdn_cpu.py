"""The CPU's GDN decode kernel (kernels/gdn_cpu.c) against its oracle, the torch reference (kernels/gdn.py's
_delta_rule_step on the "torch" backend): a layer of a pool of several layers, scattered slots, grouped heads,
float32 and bfloat16 activations, the state dims of the models; the same bits for a sequence alone and in a batch;
a NEXTN verify through it giving its decodes' bits; the reference where it cannot run (a bfloat16 state pool). The
independent loop oracle of tests/test_kernels.py runs through it too (the "auto" backend)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyserve.kernels import PoolLayer, backend_set_to, gdn_cpu
from tinyserve.kernels.gdn import recurrent_gated_delta_rule_decode, recurrent_gated_delta_rule_verify
from tinyserve.kernels.verify_layout import verify_layout

pytestmark = pytest.mark.skipif(gdn_cpu.library() is None, reason="no C / C++ compiler to build the kernel")


def inputs(N: int, H: int, HV: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = (F.normalize(torch.randn(N, H, dk, generator=gen), dim=-1) * dk ** -0.5).to(dtype)
    k = F.normalize(torch.randn(N, H, dk, generator=gen), dim=-1).to(dtype)
    v = torch.randn(N, HV, dv, generator=gen).to(dtype)
    return q, k, v, -torch.rand(N, HV, generator=gen), torch.rand(N, HV, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, HV, dk, dv", [(2, 4, 16, 8), (8, 16, 64, 64), (16, 32, 128, 128), (1, 3, 32, 24)])
def test_kernel_matches_reference_in_a_pool_layer(dtype, H, HV, dk, dv):
    slots, N = 7, 4
    gen = torch.Generator().manual_seed(dk + dv)
    pool = torch.randn(slots, 3, HV, dk, dv, generator=gen) * 0.5        # [rows, layers, ...]: layer 1 is ours
    rows = torch.tensor([5, 0, 3, 6])
    q, k, v, g, beta = inputs(N, H, HV, dk, dv, dtype, seed=H)
    mine, ref = pool.clone(), pool.clone()
    assert gdn_cpu.usable(v, PoolLayer(mine, 1))
    out = recurrent_gated_delta_rule_decode(q, k, v, g, beta, PoolLayer(mine, 1), rows)
    with backend_set_to("torch"):
        expected = recurrent_gated_delta_rule_decode(q, k, v, g, beta, PoolLayer(ref, 1), rows)
    assert out.dtype == dtype and out.shape == (N, HV, dv)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    others = [r for r in range(slots) if r not in rows.tolist()]
    assert torch.equal(mine[others], pool[others])                          # other slots untouched
    assert torch.equal(mine[:, [0, 2]], pool[:, [0, 2]])                    # other layers untouched


def test_a_sequence_decodes_to_the_same_bits_alone_and_batched():
    H, HV, dk, dv = 8, 16, 64, 64
    pool = torch.randn(9, HV, dk, dv, generator=torch.Generator().manual_seed(3)) * 0.5
    q, k, v, g, beta = inputs(6, H, HV, dk, dv, torch.bfloat16, seed=4)
    batched, alone = pool.clone(), pool.clone()
    out = recurrent_gated_delta_rule_decode(q, k, v, g, beta, batched, torch.tensor([8, 1, 4, 0, 2, 6]))
    one = recurrent_gated_delta_rule_decode(q[2:3], k[2:3], v[2:3], g[2:3], beta[2:3], alone, torch.tensor([4]))
    assert torch.equal(out[2:3], one)
    assert torch.equal(batched[4], alone[4])


@pytest.mark.parametrize("lens", [[3, 1, 4], [4]], ids=["ragged", "lone"])
def test_verify_gives_the_bits_of_its_decodes(lens):
    """A NEXTN verify through the kernel (one call a token) against the same tokens decoded one step at a time:
    equal outputs and states, to the bit (NEXTN is lossless only so)."""
    H, HV, dk, dv, n = 2, 4, 32, 32, len(lens)
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    out_slots = [list(range(n + cu[i], n + cu[i + 1])) for i in range(n)]
    state = torch.randn(n + cu[-1] + 2, HV, dk, dv, generator=torch.Generator().manual_seed(n)) * 0.5
    before = state.clone()
    q, k, v, g, beta = inputs(cu[-1], H, HV, dk, dv, torch.float32, seed=9)
    lay = verify_layout(cu, [30 + m for m in lens], list(range(n)), out_slots, "cpu")
    out = recurrent_gated_delta_rule_verify(q, k, v, g, beta, state, lay)
    for i in range(n):
        decoded, dec = before.clone(), []
        for j, t in enumerate(range(cu[i], cu[i + 1])):
            dec.append(recurrent_gated_delta_rule_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                         beta[t:t + 1], decoded, torch.tensor([i])))
            assert torch.equal(state[out_slots[i][j]], decoded[i])
        assert torch.equal(out[cu[i]:cu[i + 1]], torch.cat(dec))
    written = {s for slots in out_slots for s in slots}
    for untouched in sorted(set(range(state.shape[0])) - written):
        assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("dtype, dv", [(torch.bfloat16, 8), (torch.float32, gdn_cpu.MAX_DV + 8)],
                         ids=["bfloat16 pool", "wide heads"])
def test_what_the_kernel_does_not_take_runs_the_reference(dtype, dv):
    H, HV, dk = 2, 4, 16
    pool = (torch.randn(3, HV, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)
    q, k, v, g, beta = inputs(2, H, HV, dk, dv, torch.float32, seed=2)
    assert not gdn_cpu.usable(v, PoolLayer.of(pool))
    mine, ref = pool.clone(), pool.clone()
    out = recurrent_gated_delta_rule_decode(q, k, v, g, beta, mine, torch.tensor([2, 0]))
    with backend_set_to("torch"):
        expected = recurrent_gated_delta_rule_decode(q, k, v, g, beta, ref, torch.tensor([2, 0]))
    assert torch.equal(out, expected) and torch.equal(mine, ref)


def test_without_a_cpp_compiler_the_reference_runs(monkeypatch, tmp_path, caplog):
    """The kernel's library built without its torch op (no C++ compiler): no op to call, so the reference runs,
    and the warnings say so (not that a Python op runs, as the other kernels' fallbacks do)."""
    H, HV, dk, dv = 2, 4, 16, 8
    pool = torch.randn(3, HV, dk, dv, generator=torch.Generator().manual_seed(5)) * 0.5
    q, k, v, g, beta = inputs(2, H, HV, dk, dv, torch.float32, seed=6)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # nothing built there yet
    gdn_cpu.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tinyserve.kernels"):
            assert gdn_cpu.library() is None and not gdn_cpu.usable(v, PoolLayer.of(pool))
        mine = pool.clone()
        out = recurrent_gated_delta_rule_decode(q, k, v, g, beta, mine, torch.tensor([2, 0]))
    finally:
        monkeypatch.undo()
        gdn_cpu.library.cache_clear()
    assert "torch reference" in caplog.text and "runs in Python" not in caplog.text
    ref = pool.clone()
    with backend_set_to("torch"):
        expected = recurrent_gated_delta_rule_decode(q, k, v, g, beta, ref, torch.tensor([2, 0]))
    assert torch.equal(out, expected) and torch.equal(mine, ref)
