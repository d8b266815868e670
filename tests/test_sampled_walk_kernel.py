"""The sampled tree walk's Triton kernel (kernels/sampled_walk.py) against the torch walk
(accept.sampled_walk on the softmax of the same processed logits, greedy rows on the one-hot of
their argmax), given the same uniforms: the same result on random ragged trees (suffixes,
duplicate heads, placeholder tokens, trees without suffixes or nodes, rows cut to -inf as top-k
leaves them, greedy and sampled requests mixed, rows spanning several tiles). Compiled on a CUDA
device when there is one, else run by Triton's CPU interpreter (TRITON_INTERPRET handled as in
tests/test_fused_ops.py). The two sum in different orders, so a uniform within rounding of a
boundary could split them; the seeds here are fixed, and the counts of decisions compared are
printed."""


import numpy as np
import pytest
import torch

from conftest import DEVICE, import_kernel_module, needs_triton

sw = import_kernel_module("vllm_ouroboros.kernels.sampled_walk")

from vllm_ouroboros.accept import sampled_walk, walk_steps  # noqa: E402
from vllm_ouroboros.tree import build_tree  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"), needs_triton(sw, sw.sampled_walk_kernel)]


def random_case(seed, B, D, K, L, V, hot=2, placeholder=False):
    g = torch.Generator(DEVICE).manual_seed(seed)
    ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g, device=DEVICE)  # noqa: E731
    draft = ri(0, hot, B, D)
    if placeholder:
        draft[0, 0] = -1  # vLLM's placeholder draft token: never accepted
    tree = build_tree(draft, ri(0, D + 1, B), ri(0, hot, B, K, L), ri(0, L + 1, B, K))
    N1 = tree.N + 1
    x = torch.randn(B * N1, V, generator=g, device=DEVICE)
    x[:, :hot] += 6.0  # the tree's tokens are likely: deep walks
    cut = torch.rand(B * N1, V, generator=g, device=DEVICE) < 0.3
    cut[:, :hot] = False
    x = x.masked_fill(cut, float("-inf"))  # what top-k / top-p leave
    greedy = torch.rand(B, generator=g, device=DEVICE) < 0.3
    u = torch.rand(B, walk_steps(tree), max(K, 1) + 1, generator=g, device=DEVICE)
    return tree, x, greedy, u


def torch_walk(tree, x, greedy, u):
    B, N1 = tree.B, tree.N + 1
    probs = torch.softmax(x.view(B, N1, -1), dim=-1)
    one_hot = torch.nn.functional.one_hot(x.view(B, N1, -1).argmax(-1), x.shape[1]).float()
    return sampled_walk(tree, torch.where(greedy[:, None, None], one_hot, probs), uniforms=u)


def kernel_walk(tree, x, greedy, u, block_v=sw.BLOCK_V):
    tn = x.view(tree.B, tree.N + 1, -1).argmax(-1)
    return sw.sampled_walk_triton(x, tn, greedy, tree.tokens, tree.branch_of, tree.draft_len,
                                  tree.suffix_start, tree.suffix_len, u, block_v=block_v)


@pytest.mark.parametrize("seed,B,D,K,L,V,block_v", [
    (0, 12, 4, 3, 2, 64, 1024),
    (1, 8, 6, 2, 3, 300, 64),     # rows over 5 tiles, the last partial
    (2, 8, 3, 0, 1, 50, 16),      # no suffixes: the chain
    (3, 12, 2, 4, 3, 40, 1024),
])
def test_kernel_walks_as_the_torch_walk(seed, B, D, K, L, V, block_v):
    accepted = 0
    for rep in range(6):
        tree, x, greedy, u = random_case(100 * seed + rep, B, D, K, L, V, placeholder=rep == 0)
        want = torch_walk(tree, x, greedy, u)
        got = kernel_walk(tree, x, greedy, u, block_v)
        assert torch.equal(got, want), f"rep {rep}:\nkernel {got.tolist()}\ntorch  {want.tolist()}"
        accepted += int(want[0].sum() + want[2].sum())
    assert accepted >= 2 * B  # the walks went past the root's children
    print(f"equal walks: {accepted} tokens accepted, {6 * B} stops")


def test_children_holding_the_whole_residual_leave_no_empty_draw():
    """Top-k leaves two tokens, both the root's children (single-token branches). The first is
    rejected (u near 1); the second then holds all the mass, but the kernel's running mass is
    a few ulps above its probability, so u = 1 - 2^-24 rejected it too and the residual had
    nothing left: the kernel drew token -1 where the torch walk accepts the child. It now
    draws that child's token (the whole residual), never -1."""
    tree = build_tree(torch.zeros(1, 1, dtype=torch.long, device=DEVICE), torch.tensor([0], device=DEVICE),
                      torch.tensor([[[0], [1]]], device=DEVICE), torch.tensor([[1, 1]], device=DEVICE))
    V, u2 = 8, float(np.float32(1) - np.float32(2.0 ** -24))
    xb = next(xb for xb in np.linspace(-3, -0.1, 2000).astype(np.float32)
              if u2 * (np.float32(1) + np.exp(xb) - np.float32(1)) >= np.exp(xb))
    x = torch.full((tree.N + 1, V), float("-inf"), device=DEVICE)
    x[:, 0], x[:, 1] = 0.0, float(xb)
    u = torch.tensor([[[0.9999, u2, 0.5]] * walk_steps(tree)], device=DEVICE)
    greedy = torch.tensor([False], device=DEVICE)
    got = kernel_walk(tree, x, greedy, u).view(-1).tolist()
    want = torch_walk(tree, x, greedy, u).view(-1).tolist()
    assert want == [0, 1, 1, 0]  # the torch walk takes the second child, then draws token 0
    # The kernel takes the child as the torch walk does (where its rounding allows, as a GPU's
    # exp may), or draws that child's token at the root (the interpreter's rounding here).
    assert got in (want, [0, 0, 0, 1]), got


def test_kernel_handles_a_tree_without_nodes():
    empty = torch.zeros(3, 0, dtype=torch.long, device=DEVICE)
    tree = build_tree(empty, torch.zeros(3, dtype=torch.long, device=DEVICE),
                      torch.zeros(3, 0, 2, dtype=torch.long, device=DEVICE), torch.zeros(3, 0, dtype=torch.long, device=DEVICE))
    g = torch.Generator(DEVICE).manual_seed(0)
    x = torch.randn(3, 20, generator=g, device=DEVICE)
    greedy = torch.tensor([True, False, False], device=DEVICE)
    u = torch.rand(3, walk_steps(tree), 2, generator=g, device=DEVICE)
    got = kernel_walk(tree, x, greedy, u)
    assert torch.equal(got, torch_walk(tree, x, greedy, u))
    assert got[3, 0] == x[0].argmax() and (got[:3] == 0).all()


def test_wrapper_rejects_bad_inputs():
    tree, x, greedy, u = random_case(0, 2, 2, 1, 1, 16)
    with pytest.raises(ValueError, match="float32"):
        kernel_walk(tree, x.double(), greedy, u)
    with pytest.raises(ValueError, match="uniforms"):
        kernel_walk(tree, x, greedy, u[..., :1])


def test_check_kernel_passes_and_catches_a_wrong_walk(monkeypatch):
    assert sw.check_kernel(torch.device(DEVICE), 3, 100) is None
    real = sw.sampled_walk_triton

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out[3] = (out[3] + 1) % 100  # the token drawn after the last acceptance
        return out

    monkeypatch.setattr(sw, "sampled_walk_triton", off_by_one)
    assert "differs from the torch walk" in sw.check_kernel(torch.device(DEVICE), 3, 100)


@pytest.mark.parametrize("seed", range(2))
def test_verify_walks_with_the_kernel_as_with_torch(seed):
    """verify.verify(walk="triton"): the same result as the torch walk, with the caller's
    uniforms or drawn from its generator as the torch walk draws them, whether the batch's rows
    fit in max_table_rows (one launch) or go in chunks (of 2 requests, of 1)."""
    from vllm_ouroboros.verify import verify

    tree, x, greedy, u = random_case(7 + seed, 6, 4, 3, 2, 64)
    row_start = np.arange(tree.B) * (tree.N + 1)
    process = lambda x, req: x.div_(0.9)  # noqa: E731
    launches = []
    real = sw.sampled_walk_triton

    def counted(*args, **kwargs):
        launches.append(args[1].shape[0])  # the chunk's requests
        return real(*args, **kwargs)

    for table_rows, chunks in ((tree.B * (tree.N + 1), [6]), (2 * (tree.N + 1) + 1, [2, 2, 2]), (0, [1] * 6)):
        for kwargs in (dict(uniforms=u), dict(generator=lambda: torch.Generator(DEVICE).manual_seed(seed))):
            runs = []
            for walk in ("torch", "triton"):
                kw = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
                launches.clear()
                sw.sampled_walk_triton = counted
                try:
                    runs.append(verify(tree, x, row_start, greedy, process, max_table_rows=table_rows,
                                       walk=walk, **kw).result)
                finally:
                    sw.sampled_walk_triton = real
            assert launches == chunks
            assert np.array_equal(runs[0].emitted, runs[1].emitted)
            assert np.array_equal(runs[0].kv_keep_src, runs[1].kv_keep_src)
    with pytest.raises(ValueError, match="walk must be"):
        verify(tree, x, row_start, greedy, process, walk="cuda")


def _two_children_at_the_root(V, delta):
    """One request, no draft, two single-token branches: token 0 holds 1 - delta of the root's
    distribution, token 1 delta / 2, the other V - 2 tokens the rest, spread (log-noise)."""
    g = torch.Generator(DEVICE).manual_seed(5)
    tree = build_tree(torch.zeros(1, 0, dtype=torch.long, device=DEVICE), torch.tensor([0], device=DEVICE),
                      torch.tensor([[[0], [1]]], device=DEVICE), torch.tensor([[1, 1]], device=DEVICE))
    rest = torch.rand(V - 2, generator=g, dtype=torch.float64, device=DEVICE) + 0.5
    p = torch.cat([torch.tensor([1 - delta, delta / 2], dtype=torch.float64, device=DEVICE),
                   rest / rest.sum() * delta / 2])
    x = p.log().float()[None].expand(tree.N + 1, V).contiguous()
    return tree, x, p


@pytest.mark.parametrize("walk", ["kernel", "torch"])
def test_a_sibling_after_a_child_holding_nearly_all_the_mass(walk):
    """Token 0 holds 1 - 1e-6 of the root (152k tokens) and is rejected; token 1 then holds
    half the residual, so u < 0.5 accepts it and u > 0.5 does not. The kernel's residual was
    the online float32 normaliser less token 0's term, off by a large part of the 1e-6 left
    (up to 36% at 1e-5): the decision followed the rounding, not u."""
    V = 152064
    tree, x, p = _two_children_at_the_root(V, 1e-6)
    greedy = torch.tensor([False], device=DEVICE)
    for u1, accepted in ((0.40, True), (0.47, True), (0.53, False), (0.60, False)):
        u = torch.tensor([[[1 - 1e-9, u1, 0.5]] * walk_steps(tree)], dtype=torch.float64, device=DEVICE)
        out = (kernel_walk(tree, x, greedy, u) if walk == "kernel" else torch_walk(tree, x, greedy, u)).view(-1)
        assert (int(out[2]) == 1) == accepted, (u1, out.tolist())
        if accepted:
            assert int(out[1]) == 1  # along the second branch


@pytest.mark.parametrize("walk", ["kernel", "torch"])
def test_the_draw_resolves_probabilities_below_float32_steps(walk):
    """Both children (tokens 0, 1) rejected; the residual is tokens 2 and 4 of equal weight and
    token 3 between them at e^-25 of theirs (1.4e-11), the rest cut (-inf). A uniform of 1/2
    falls in the middle of token 3's interval of the CDF: token 3 comes out. In float32 the
    CDF steps by 2^-24 there, token 3's interval vanished, and the draw gave token 4."""
    tree = build_tree(torch.zeros(1, 0, dtype=torch.long, device=DEVICE), torch.tensor([0], device=DEVICE),
                      torch.tensor([[[0], [1]]], device=DEVICE), torch.tensor([[1, 1]], device=DEVICE))
    x = torch.full((tree.N + 1, 8), float("-inf"), device=DEVICE)
    x[:, :5] = torch.tensor([4.0, 4.0, 0.0, -25.0, 0.0])
    greedy = torch.tensor([False], device=DEVICE)
    u = torch.tensor([[[1 - 1e-12, 1 - 1e-12, 0.5]] * walk_steps(tree)], dtype=torch.float64, device=DEVICE)
    out = (kernel_walk(tree, x, greedy, u) if walk == "kernel" else torch_walk(tree, x, greedy, u)).view(-1)
    assert out.tolist() == [0, 0, 0, 3]


@pytest.mark.parametrize("walk", ["kernel", "torch"])
def test_a_branch_with_an_out_of_vocabulary_head_never_joins_the_path(walk):
    """Branches [0, 5] and [-1, 7] (a placeholder head): token 0 is accepted at the root. The
    second branch's head was clamped to 0 before the comparison, so it stayed live and its 7
    was accepted next, reported along branch 1, whose emitted tokens start with -1. It is not
    live: 5 is rejected and 7 drawn from the residual, along branch 0."""
    tree = build_tree(torch.zeros(1, 0, dtype=torch.long, device=DEVICE), torch.tensor([0], device=DEVICE),
                      torch.tensor([[[0, 5], [-1, 7]]], device=DEVICE), torch.tensor([[2, 2]], device=DEVICE))
    x = torch.full((tree.N + 1, 8), float("-inf"), device=DEVICE)
    x[0, 0] = 0.0  # the root: token 0 surely
    x[1:, 7] = 0.0  # after any node: token 7 surely
    greedy = torch.tensor([False], device=DEVICE)
    u = torch.full((1, walk_steps(tree), 3), 0.5, dtype=torch.float64, device=DEVICE)
    out = (kernel_walk(tree, x, greedy, u) if walk == "kernel" else torch_walk(tree, x, greedy, u)).view(-1)
    assert out.tolist() == [0, 0, 1, 7]
