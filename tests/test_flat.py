import pytest
import torch

from lightning_loco.algorithms.outer_optimizer import parameter_views
from lightning_loco.driver.flat import FlatParameters


def test_gather_scatter_round_trip_with_mixed_dtypes():
    a = torch.nn.Parameter(torch.randn(3, 2))
    b = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    c = torch.nn.Parameter(torch.randn(2, 2).t())  # not contiguous
    flat = FlatParameters([a, b, c], "cpu")
    v = flat.gather()
    assert v.dtype == torch.float32 and v.numel() == 14
    assert torch.equal(v[:6], a.detach().reshape(-1))
    assert torch.equal(v[6:10], b.detach().float())
    assert torch.equal(v[10:], c.detach().reshape(-1))
    new = torch.arange(14, dtype=torch.float32) / 3
    flat.scatter(new)
    assert torch.equal(a.detach().reshape(-1), new[:6])
    assert b.dtype == torch.bfloat16 and torch.equal(b.detach(), new[6:10].to(torch.bfloat16))
    assert torch.equal(c.detach().reshape(-1), new[10:])
    with pytest.raises(ValueError, match="14"):
        flat.scatter(torch.zeros(3))


def test_parameter_views_share_storage_and_an_optimizer_steps_the_flat_buffer():
    buf = torch.zeros(7)
    views = parameter_views(buf, [torch.Size([2, 2]), torch.Size([3])])
    assert all(v.is_leaf for v in views)
    grad = torch.ones(7)
    for v, g in zip(views, parameter_views(grad, [torch.Size([2, 2]), torch.Size([3])])):
        v.grad = g.detach()
    torch.optim.SGD(views, lr=0.5).step()
    assert torch.equal(buf, torch.full((7,), -0.5))
    with pytest.raises(ValueError):
        parameter_views(buf, [torch.Size([2])])
