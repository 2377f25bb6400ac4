"""Moving flat buffers between replicas: the interface and the shared ``Pending`` (``base``),
torch.distributed (``torch_dist``; waiting for its works in ``pending_sum``, its streams in ``streams``, its lossy
wire formats in ``wire.coded``), and in-process (``in_process``)."""

from lightning_loco.transport.base import PeerError, Pending, Transport, TransportStats, sum_in_group_order
from lightning_loco.transport.in_process import InProcessNetwork, InProcessTransport
from lightning_loco.transport.torch_dist import PendingSum, TorchDistributedTransport

__all__ = [
    "InProcessNetwork",
    "InProcessTransport",
    "Pending",
    "PendingSum",
    "PeerError",
    "TorchDistributedTransport",
    "Transport",
    "TransportStats",
    "sum_in_group_order",
]
