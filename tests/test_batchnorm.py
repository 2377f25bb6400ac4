"""BatchNorm's statistics for the consensus: re-estimated (lightning_loco.replica.batchnorm) against averaged."""

import pytest
import torch
from torch import nn

import lightning_loco
from lightning_loco.replica.batchnorm import reestimate

import tiny


def test_reestimate_is_update_bn_and_puts_the_momentum_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=0.3), nn.Linear(3, 1))
    reference = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=0.3), nn.Linear(3, 1))
    reference.load_state_dict(model.state_dict())
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(5)]
    model.eval()
    assert reestimate(model, batches) == 5
    torch.optim.swa_utils.update_bn([x for x, _ in batches], reference)
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name
    assert model[1].momentum == 0.3 and not model.training  # as it was
    assert reestimate(nn.Linear(2, 2), batches) == 0 and reestimate(model, []) == 0  # nothing to do


def test_the_callback_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="batches must be an integer >= 1"):
        lightning_loco.BatchNormUpdate(batches=0)


@pytest.mark.slow
def test_after_fit_every_rank_holds_statistics_re_estimated_under_the_consensus_weights(tmp_path):
    """N = 4, a BatchNorm model: with BatchNormUpdate(batches=2) the statistics every rank ends with are the
    average over the ranks of update_bn on its own next two batches under the consensus weights, not the
    replicas' averaged statistics (what fit leaves without it)."""
    n, steps = 4, 6
    plain = tiny.launch(tmp_path / "plain", strategy="noloco", strategy_kwargs={"sync_every": 3}, devices=n,
                        max_steps=steps, batchnorm=True)
    updated = tiny.launch(tmp_path / "updated", strategy="noloco", strategy_kwargs={"sync_every": 3}, devices=n,
                          max_steps=steps, batchnorm=True, batchnorm_update={"batches": 2})
    after = [torch.load(tmp_path / "updated" / "out" / f"after_fit{r}.pt") for r in range(n)]
    before = torch.load(tmp_path / "plain" / "out" / "after_fit0.pt")
    assert torch.equal(updated[0]["weights"][-1], plain[0]["weights"][-1])  # training is the same
    # what each rank's forward passes gave, by hand: the consensus weights, each rank's next batches
    model = tiny.TinyRegressor(batchnorm=True)
    flat = after[0]["weights"]
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    data = tiny.dataset()
    per_rank = []
    for r in range(n):
        epoch = steps // 3  # three batches an epoch per rank; after fit the sampler keeps its last epoch (1)
        batches = [(data.tensors[0][b], data.tensors[1][b]) for b in tiny.shard_batches(r, n, 4, epoch - 1)][:2]
        reestimate(model, batches)
        per_rank.append({k: v.clone() for k, v in model.named_buffers() if v.is_floating_point()})
    for name in ("norm.running_mean", "norm.running_var"):
        expected = torch.stack([b[name] for b in per_rank]).mean(0)
        for rec in after:
            torch.testing.assert_close(rec["buffers"][name], expected, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(before["buffers"][name], expected, atol=1e-4)  # not the averaged statistics
