"""mHC (moesaic/layers/mhc.py) against transformers' glm5_next and deepseek_v4 hyper-connection modules."""

import pytest
import torch
from helpers import max_err
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.glm5_next import modeling_glm5_next as hf_glm
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from moesaic.layers import mhc
from moesaic.layers.mhc import MhcDims, MhcSite

N_HC, D, T = 4, 24, 7
TOL = 1e-5  # fp32 (measured: bit-equal to transformers on these inputs)


def hf_site(module_cls, cfg, seed):
    g = torch.Generator().manual_seed(seed)
    m = module_cls(cfg)
    with torch.no_grad():
        m.fn.copy_(torch.randn(m.fn.shape, generator=g) * 0.3)
        m.base.copy_(torch.randn(m.base.shape, generator=g))
        m.scale.copy_(1 + 0.5 * torch.randn(3, generator=g))
    return m


def streams(seed, dtype=torch.float32, t=T):
    return (torch.randn(1, t, N_HC, D, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def glm_cfg(**over):
    kw = dict(
        hidden_size=D, hc_mult=N_HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5, num_hidden_layers=1
    )
    kw.update(over)
    return Glm5NextTextConfig(**kw)


def ours_from(m, cfg):
    dims = MhcDims(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    return MhcSite(m.fn.detach(), m.base.detach(), m.scale.detach()), dims


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_site_matches_glm5_next(iters):
    cfg = glm_cfg(hc_sinkhorn_iters=iters)
    m = hf_site(hf_glm.Glm5NextTextHyperConnection, cfg, seed=iters)
    site, dims = ours_from(m, cfg)
    h = streams(iters)
    with torch.no_grad():
        post_ref, comb_ref, x_ref = m(h)
    x, post, comb = mhc.site_input(h[0], site, dims)
    errs = max_err(x, x_ref[0]), max_err(post, post_ref[0]), max_err(comb, comb_ref[0])
    print(f"mhc glm5_next iters={iters}: collapsed {errs[0]:.1e} post {errs[1]:.1e} comb {errs[2]:.1e}")
    assert max(errs) < TOL
    # the block update, as the decoder layer writes it
    y = torch.randn(T, D)
    ref = post_ref[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_ref[0].transpose(-1, -2), h[0])
    assert max_err(mhc.update(h[0], y, post, comb), ref) < 1e-5


def test_comb_is_doubly_stochastic_and_not_symmetric():
    cfg = glm_cfg()
    m = hf_site(hf_glm.Glm5NextTextHyperConnection, cfg, seed=5)
    site, dims = ours_from(m, cfg)
    _, _, comb = mhc.site_maps(streams(5)[0], site, dims)
    assert max_err(comb.sum(-2), torch.ones(T, N_HC)) < 1e-5  # the last normalisation is by column
    assert max_err(comb.sum(-1), torch.ones(T, N_HC)) < 5e-2  # 20 rounds: rows close, not exact
    assert max_err(comb, comb.transpose(-1, -2)) > 1e-3  # the contraction index matters


def test_contracting_the_wrong_index_fails_the_oracle():
    # broken twin: Σ_j comb[k, j] h[j] instead of Σ_j comb[j, k] h[j]
    cfg = glm_cfg()
    m = hf_site(hf_glm.Glm5NextTextHyperConnection, cfg, seed=6)
    site, dims = ours_from(m, cfg)
    h, y = streams(6)[0], torch.randn(T, D)
    _, post, comb = mhc.site_input(h, site, dims)
    with torch.no_grad():
        post_ref, comb_ref, _ = m(h[None])
    ref = post_ref[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_ref[0].transpose(-1, -2), h)
    good = mhc.update(h, y, post, comb)
    broken = mhc.update(h, y, post, comb.transpose(-1, -2))
    assert max_err(good, ref) < 1e-5 and max_err(broken, ref) > 1e-3


def test_bf16_streams_follow_transformers_casts():
    cfg = glm_cfg()
    m = hf_site(hf_glm.Glm5NextTextHyperConnection, cfg, seed=7)
    site, dims = ours_from(m, cfg)
    h = streams(7, torch.bfloat16)
    with torch.no_grad():
        post_ref, comb_ref, x_ref = m(h)
    x, post, comb = mhc.site_input(h[0], site, dims)
    assert x.dtype == torch.bfloat16 and comb.dtype == torch.float32
    assert max_err(post, post_ref[0]) < TOL and max_err(comb, comb_ref[0]) < TOL
    assert max_err(x, x_ref[0]) <= 2**-7 * x_ref.abs().max().item()  # at most one bf16 rounding apart


def test_glm_final_collapse_is_the_unweighted_mean():
    h = streams(8)
    assert torch.equal(mhc.head_mean(h[0]), hf_glm.Glm5NextTextHyperHead()(h)[0])
    assert mhc.expand(h[0, :, 0], N_HC).shape == (T, N_HC, D)
    assert torch.equal(mhc.expand(h[0, :, 0], N_HC)[:, 3], h[0, :, 0])


def test_site_and_weighted_head_match_deepseek_v4():
    cfg = DeepseekV4Config(hidden_size=D, hc_mult=N_HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    m = hf_site(v4.DeepseekV4HyperConnection, cfg, seed=9)
    site, dims = ours_from(m, cfg)
    h = streams(9)
    with torch.no_grad():
        post_ref, comb_ref, x_ref = m(h)
    x, post, comb = mhc.site_input(h[0], site, dims)
    assert max(max_err(x, x_ref[0]), max_err(post, post_ref[0]), max_err(comb, comb_ref[0])) < TOL

    head = v4.DeepseekV4HyperHead(cfg)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        head.hc_fn.copy_(torch.randn(head.hc_fn.shape, generator=g) * 0.3)
        head.hc_base.copy_(torch.randn(N_HC, generator=g))
        head.hc_scale.copy_(torch.tensor([1.3]))
        ref = head(h)[0]
    got = mhc.head_weighted(h[0], head.hc_fn, head.hc_base, head.hc_scale, dims)
    err = max_err(got, ref)
    print(f"mhc deepseek_v4 weighted head {err:.1e}")
    assert err < TOL
    assert max_err(got, mhc.head_mean(h[0])) > 1e-2  # the weighted head is not GLM's mean


def test_bf16_site_weight_takes_the_kernel_without_an_fp32_copy():
    """A bf16 model's site projection runs the bf16 kernel on fp32 rows (fn never converted): the fp32
    product of the torch path (F.linear on fn.float()) to fp32 rounding, and no aten copy of fn."""
    from moesaic.kernels import cpu

    if not cpu.available():
        pytest.skip("CPU kernels unavailable")
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 4, 64, generator=g).bfloat16()
    fn = (torch.randn(24, 256, generator=g) * 0.1).bfloat16()

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.sizes.append(out.numel())
            return out

    with torch.inference_mode(), Sizes() as seen:
        m = mhc.project(h, fn, 1e-6)
    assert fn.numel() not in seen.sizes  # no fp32 copy of fn
    flat = h.reshape(3, -1).float()
    ref = torch.nn.functional.linear(
        flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6), fn.float()
    )
    assert m.dtype == torch.float32
    torch.testing.assert_close(m, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_site_maps_keep_their_bits_at_every_batch_size(dtype):
    """site_maps scales the projected row in one product (a per-column scale vector) and keeps each sigmoid
    over its own contiguous [N, n]: the same bits as the map-by-map formula below at every N (torch's
    sigmoid rounds differently in its vector and its scalar code, and which it takes follows the layout)."""
    g = torch.Generator().manual_seed(3)
    n, d = 4, 64
    dims = MhcDims(n, 20, 1e-6, 1e-5)
    site = MhcSite(
        (torch.randn((2 + n) * n, n * d, generator=g) * 0.05).to(dtype), torch.randn(24), torch.rand(3)
    )
    for N in (1, 3, 8, 17, 130):
        x = torch.randn(N, n, d, generator=g).to(dtype)
        m = mhc.project(x, site.fn, dims.norm_eps)
        b, s = site.base, site.scale
        pre = torch.sigmoid(m[..., :n] * s[0] + b[:n]) + dims.hc_eps
        post = 2 * torch.sigmoid(m[..., n : 2 * n] * s[1] + b[n : 2 * n])
        comb = mhc.sinkhorn(
            (m[..., 2 * n :] * s[2] + b[2 * n :]).view(N, n, n), dims.sinkhorn_iters, dims.hc_eps
        )
        got = mhc.site_maps(x, site, dims)
        assert all(torch.equal(u, v) for u, v in zip(got, (pre, post, comb))), N
