"""mHC (layers/mhc.py) against transformers' GLM-5 next hyper-connection and its decoder layer's stream update."""
import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

from latentserve.layers.hyper_connection import HyperConnectionConfig
from latentserve.layers.mhc import MHCConnection, mean_of_streams, mix_streams


def _pair(hidden: int = 16, n: int = 4, iters: int = 20) -> tuple[Glm5NextTextHyperConnection, MHCConnection]:
    torch.manual_seed(0)
    hf = Glm5NextTextHyperConnection(Glm5NextTextConfig(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters,
                                                        num_hidden_layers=4, index_topk=16))
    with torch.no_grad():
        hf.fn.normal_(0, 0.3)
        hf.base.normal_()
        hf.scale.uniform_(0.5, 2.0)
    ours = MHCConnection(hidden, HyperConnectionConfig(n, 2.0, hf.hc_eps, hf.input_norm.variance_epsilon, iters))
    ours.load_state_dict({k: v for k, v in hf.state_dict().items()})
    return hf, ours


@pytest.mark.parametrize("iters", [1, 20])
def test_mhc_matches_transformers(iters: int) -> None:
    hf, ours = _pair(iters=iters)
    streams = torch.randn(5, 4, 16)
    post_ref, comb_ref, x_ref = hf(streams[None])
    post, comb, x = ours(streams)
    torch.testing.assert_close(post, post_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, x_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)  # columns normalized last
    out = torch.randn(5, 16)
    ref = post_ref[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb_ref[0].transpose(-1, -2), streams)
    torch.testing.assert_close(mix_streams(streams, post, comb, out), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_of_streams(streams), streams.mean(1))


def test_mhc_rejects_negative_iterations() -> None:
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        HyperConnectionConfig(4, 2.0, 1e-6, 1e-6, -1)
