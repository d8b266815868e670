"""The sampled tree walk (lossless multi-candidate rejection sampling) as one Triton kernel.

accept.sampled_walk, the torch walk, is some 140 small ATen operations per depth step (the
candidates of the step, then one try per child: gather, sum, compare, scatter): about 1,900 for
a 13-step tree walk, each a kernel launch on a GPU, where the walk is launch-bound whatever the
batch. Here one program per request walks its tree in one launch: per depth step it reads the
row it stands on (processed logits: the softmax is taken on the fly, one pass for its maximum
and normaliser), tries its children in order, and where all are rejected samples from the
residual in one more pass. The residual is the row with the rejected children's tokens (at most
max(K, 1) per step) zeroed, kept as that list: nothing is written but the result.

Same walk, same uniforms, same decisions as accept.sampled_walk on softmax(logits) (the
reference): only sums are taken in another order, so a decision can differ where a uniform
falls within rounding of a boundary (tests/test_sampled_walk_kernel.py compares them).

In this file: the kernel, its host wrapper `sampled_walk_triton` (None where Triton cannot run:
the caller takes the torch walk), and `check_kernel`, which an engine runs at its start.
"""

from __future__ import annotations

import contextlib

import torch

from .triton_runtime import import_triton, pick_kernel

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

BLOCK_V = 1024  # vocabulary entries per pass tile

if triton is not None:

    # Nothing but the constexprs and dtypes may pick the binary: the step's tree tensors are
    # views at any offset of one packed upload (host_copy.packed_copy) and its sizes change
    # every step, and the one compile happens at the engine's start (check_kernel).
    @triton.jit(do_not_specialize=["x_ptr", "stride_x", "tn_ptr", "greedy_ptr", "tokens_ptr",
                                   "branch_ptr", "draft_len_ptr", "sstart_ptr", "slen_ptr", "u_ptr",
                                   "out_ptr", "B", "N", "N1", "K", "S", "V"])
    def sampled_walk_kernel(
        x_ptr, stride_x,        # [B * N1, V] float32 processed logits, row b * N1 + c
        tn_ptr,                 # [B, N1] int64 target argmax (greedy rows walk its one-hot)
        greedy_ptr,             # [B] int8
        tokens_ptr,             # [B, N] int64
        branch_ptr,             # [B, N] int64
        draft_len_ptr,          # [B] int64
        sstart_ptr, slen_ptr,   # [B, K] int64
        u_ptr,                  # [B, S, C + 1] float64
        out_ptr,                # [4, B] int64
        B, N, N1, K, S, V,
        C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        offs_c = tl.arange(0, BLOCK_C)
        c_in = offs_c < K
        sstart = tl.load(sstart_ptr + b * K + offs_c, mask=c_in, other=0)
        slen = tl.load(slen_ptr + b * K + offs_c, mask=c_in, other=0)
        n = tl.load(draft_len_ptr + b)
        is_greedy = tl.load(greedy_ptr + b) != 0
        sampled = is_greedy == 0
        offs_v = tl.arange(0, BLOCK_V)

        live = slen > 0
        cur = n * 0 - 1           # node stood on; -1 = the root (int64 like n)
        active = n * 0 + 1        # 1 while the walk goes on
        num_acc = n * 0
        last_tok = n * 0
        for t in range(0, S):
            col = cur + 1
            row = x_ptr + (b * N1 + col) * stride_x
            tn = tl.load(tn_ptr + b * N1 + col)
            in_draft = t < n
            j = t - n
            s_ok = live & (j >= 0) & (j < slen)
            s_node = tl.minimum(tl.maximum(sstart + j, 0), tl.maximum(N - 1, 0))
            cand_ok = tl.where(in_draft, (offs_c == 0) & (n > t), s_ok)
            cand_node = tl.where(in_draft, offs_c * 0 + t, s_node)
            cand_tok = tl.load(tokens_ptr + b * N + tl.minimum(cand_node, tl.maximum(N - 1, 0)),
                               mask=(offs_c < C) & (offs_c * 0 + N > 0), other=0)
            cand_tok = tl.where(N > 0, cand_tok, cand_node)
            # A token id outside the vocabulary (vLLM's -1 placeholder drafts) is never accepted.
            cand_ok = cand_ok & (offs_c < C) & (cand_tok >= 0) & (cand_tok < V)
            cand_tok = tl.minimum(tl.maximum(cand_tok, 0), V - 1)

            # The row's maximum, then its normaliser, on rows a sampled walk stands on. Two
            # passes, not an online one, so that the normaliser is the float64 sum of the very
            # float32 terms exp(x - m) that the tries and the draw below read: the residual's
            # mass is then z less the rejected children's terms, without the cancellation an
            # online sum's rescaling rounding leaves where a rejected child held nearly all of
            # it (float32 there: 36% off the residual at p = 1 - 1e-5, 152k tokens), and the
            # draw resolves probabilities far below float32's 2^-24 steps.
            n_blocks = tl.where((active != 0) & sampled, tl.cdiv(V, BLOCK_V), 0)
            m = -float("inf")
            for i in range(0, n_blocks):
                offs = i * BLOCK_V + offs_v
                xv = tl.load(row + offs, mask=offs < V, other=-float("inf"))
                m = tl.maximum(m, tl.max(xv, axis=0))
            m = tl.where(m == -float("inf"), 0.0, m)
            z = (n * 0).to(tl.float64)
            for i in range(0, n_blocks):
                offs = i * BLOCK_V + offs_v
                xv = tl.load(row + offs, mask=offs < V, other=-float("inf"))
                z += tl.sum(tl.exp(xv - m).to(tl.float64), axis=0)
            mass = tl.where(is_greedy, 1.0, z)  # the residual's mass, unnormalised (float64)

            acc = n * 0
            acc_tok = n * 0
            acc_node = n * 0
            zeroed = offs_c * 0 - 1  # tokens of the children rejected at this step
            last_rejected = n * 0 - 1
            for c in tl.static_range(C):
                pick = offs_c == c
                ok_c = tl.sum(tl.where(pick, cand_ok, False).to(tl.int32), axis=0) > 0
                tok = tl.sum(tl.where(pick, cand_tok, 0), axis=0)
                node = tl.sum(tl.where(pick, cand_node, 0), axis=0)
                try_ = (active != 0) & ok_c & (acc == 0)
                seen = tl.sum((zeroed == tok).to(tl.int32), axis=0) > 0
                xt = tl.load(row + tok, mask=try_ & sampled, other=-float("inf"))
                px = tl.where(is_greedy, tl.where(tok == tn, 1.0, 0.0), tl.exp(xt - m))
                rx = tl.where(seen, 0.0, px).to(tl.float64)
                u = tl.load(u_ptr + (b * S + t) * (C + 1) + c)
                ok = try_ & (rx > 0) & ((u * mass < rx) | (rx >= mass))
                acc = tl.where(ok, 1, acc)
                acc_tok = tl.where(ok, tok, acc_tok)
                acc_node = tl.where(ok, node, acc_node)
                rejected = try_ & (ok == 0)
                zeroed = tl.where(pick & rejected, tok, zeroed)
                last_rejected = tl.where(rejected, tok, last_rejected)
                mass = tl.where(rejected, mass - rx, mass)

            # All children rejected (or a leaf): a token from the residual by inverse CDF, the
            # first whose running sum exceeds u * mass, at most the last token with mass (a
            # rejected child never comes out; rounding past the end lands there).
            stop = (active != 0) & (acc == 0)
            target = tl.load(u_ptr + (b * S + t) * (C + 1) + C) * mass
            s_blocks = tl.where(stop & sampled, tl.cdiv(V, BLOCK_V), 0)
            run = (n * 0).to(tl.float64)
            first = V
            last_pos = -1
            for i in range(0, s_blocks):
                offs = i * BLOCK_V + offs_v
                xv = tl.load(row + offs, mask=offs < V, other=-float("inf"))
                p = tl.exp(xv - m)
                hit = tl.sum((offs[:, None] == zeroed[None, :]).to(tl.int32), axis=1) > 0
                p = tl.where(hit | (offs >= V), 0.0, p)
                p64 = p.to(tl.float64)
                cdf = tl.cumsum(p64, axis=0) + run
                first = tl.minimum(first, tl.min(tl.where(cdf > target, offs, V), axis=0))
                last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0, offs, -1), axis=0))
                run += tl.sum(p64, axis=0)
            # The residual's mass is a running difference (the torch walk sums it again): where
            # the children held all of it (top-k / top-p leaving only them), rounding can leave
            # the last child an ulp below the mass, a uniform that near 1 reject it, and no
            # token be left to draw. That child held the whole residual: it is the draw.
            drawn = tl.where(is_greedy, tn, tl.where(last_pos >= 0, tl.minimum(first, last_pos), last_rejected))
            last_tok = tl.where(stop, drawn, last_tok)
            num_acc += acc
            # Past the draft the walk goes on along every live branch carrying the accepted
            # token; cur is the first of them.
            # cand_ok, not s_ok: a branch whose token lies outside the vocabulary (clamped to
            # the accepted id above) is not the accepted path.
            live = tl.where((acc != 0) & (t >= n), cand_ok & (cand_tok == acc_tok), live)
            cur = tl.where(acc != 0, acc_node, cur)
            active = acc

        l_d = tl.minimum(num_acc, n)
        hits = num_acc - l_d
        branch = tl.load(branch_ptr + b * N + tl.maximum(cur, 0), mask=(hits > 0) & (hits * 0 + N > 0), other=0)
        tl.store(out_ptr + b, l_d)
        tl.store(out_ptr + B + b, tl.where(hits > 0, branch, 0))
        tl.store(out_ptr + 2 * B + b, hits)
        tl.store(out_ptr + 3 * B + b, last_tok)

else:  # pragma: no cover
    sampled_walk_kernel = None


def sampled_walk_triton(x: torch.Tensor, target_next: torch.Tensor, greedy: torch.Tensor,
                        tokens: torch.Tensor, branch_of: torch.Tensor, draft_len: torch.Tensor,
                        suffix_start: torch.Tensor, suffix_len: torch.Tensor,
                        uniforms: torch.Tensor, block_v: int = BLOCK_V) -> torch.Tensor | None:
    """accept.sampled_walk's result [4, B] int64 in one launch, or None where Triton cannot run.

    Shape:
      x:           [B * (N + 1), V] float32, processed logits (temperature, top-k / top-p: -inf
                   where cut) after the root (row b * (N + 1)) and after node i (+ 1 + i);
                   read only along the walked path. Rows of greedy requests are not read.
      target_next: [B, N + 1] int64, the raw argmax of each row: greedy rows walk its one-hot.
      greedy:      [B] bool.
      tokens, branch_of: [B, N] int64; draft_len [B]; suffix_start, suffix_len [B, K] int64 (the
                   TokenTree's).
      uniforms:    [B, S, max(K, 1) + 1] float64 (float32 is taken too: widened), S =
                   walk_steps(tree); float64 so that a token of probability under 2^-24
                   keeps its chance (float32 uniforms step by 2^-24).
    block_v: vocabulary entries per tile (a power of two; tests make rows span several).
    No host synchronisation.
    """
    kernel, _ = pick_kernel(sampled_walk_kernel, x.device, _TRITON_IMPORT_ERROR)
    if kernel is None:
        return None
    B, N = tokens.shape
    K = suffix_start.shape[1]
    S, C1 = uniforms.shape[1], uniforms.shape[2]
    V = x.shape[1]
    if x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[0] != B * (N + 1):
        raise ValueError(f"sampled_walk_triton: x must be [B * (N + 1), V] float32 with unit "
                         f"column stride, got {tuple(x.shape)} {x.dtype}")
    if C1 != max(K, 1) + 1 or uniforms.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"sampled_walk_triton: uniforms must be [B, S, {max(K, 1) + 1}] float64 "
                         f"(or float32), got {tuple(uniforms.shape)} {uniforms.dtype}")
    out = torch.empty(4, B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    C = max(K, 1)
    bv = min(block_v, triton.next_power_of_2(V))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        kernel[(B,)](
            x, x.stride(0), target_next.contiguous(), greedy.to(torch.int8), tokens.contiguous(),
            branch_of.contiguous(), draft_len.contiguous(), suffix_start.contiguous(),
            suffix_len.contiguous(), uniforms.to(torch.float64).contiguous(), out,
            B, N, N + 1, K, S, V,
            C=C, BLOCK_C=triton.next_power_of_2(C), BLOCK_V=bv, num_warps=8 if bv >= 1024 else 4,
        )
    return out


def check_kernel(device: torch.device, num_suffixes: int, vocab_size: int) -> str | None:
    """Compile the kernel for an engine's shapes and compare it with the torch walk on random
    trees, before serving: None if it may serve, else why not (the caller then keeps the
    torch walk). num_suffixes: the trees' K (>= 1); vocab_size: the logits' V."""
    from vllm_ouroboros.accept import sampled_walk, walk_uniforms_shape
    from vllm_ouroboros.tree import build_tree

    kernel, reason = pick_kernel(sampled_walk_kernel, device, _TRITON_IMPORT_ERROR)
    if kernel is None:
        return reason
    g = torch.Generator(device).manual_seed(0)
    B, D, K, L, V = 8, 4, max(num_suffixes, 1), 3, vocab_size
    try:
        ri = lambda hi, *shape: torch.randint(0, hi, shape, generator=g, device=device)  # noqa: E731
        tree = build_tree(ri(2, B, D), ri(D + 1, B), ri(2, B, K, L), ri(L + 1, B, K))
        x = torch.randn(B * (tree.N + 1), V, generator=g, device=device)
        x[:, :2] += 8.0  # deep walks
        greedy = torch.arange(B, device=device) % 3 == 0
        u = torch.rand(walk_uniforms_shape(tree), generator=g, device=device, dtype=torch.float64)
        tn = x.view(B, tree.N + 1, V).argmax(-1)
        got = sampled_walk_triton(x, tn, greedy, tree.tokens, tree.branch_of, tree.draft_len,
                                  tree.suffix_start, tree.suffix_len, u)
        probs = torch.softmax(x.view(B, tree.N + 1, V), dim=-1)
        probs = torch.where(greedy[:, None, None], torch.nn.functional.one_hot(tn, V).float(), probs)
        want = sampled_walk(tree, probs, uniforms=u)
        if not torch.equal(got, want):
            return f"the kernel's walk differs from the torch walk ({got.tolist()} vs {want.tolist()})"
    except Exception as e:  # noqa: BLE001 - any failure means: keep the torch walk
        return f"the kernel failed its check: {type(e).__name__}: {e}"
    return None

