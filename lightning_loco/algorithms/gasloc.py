"""GASLoC's outer step (Cagnasso, Belilovsky, Oyallon, arXiv 2606.11081): gossip, then extrapolate.

**A reconstruction.** The paper's full text and code were not available to us. What is known: gossip
over sparse random one- or two-peer matchings instead of an all-reduce, local steps, the outer
momentum reread as gossip acceleration, compatibility with adaptive outer optimizers, and exact
DiLoCo on a complete graph. The update below is the form that satisfies all of those statements::

    g_i = θ_i,H − θ_i                              # pseudo-gradient of the inner phase
    z_i = θ_i + η·g_i                              # η = outer_lr
    x_i = z_i − α·Σ_{j ∈ M_t(i)} (z_i − z_j)       # α = gossip_step, M_t the round's matching
    θ_i ← x_i + γ·(x_i − x_prev_i);  x_prev_i ← x_i   # γ = outer_momentum

The last line is exactly ``torch.optim.SGD(lr=1, momentum=γ, nesterov=True)`` stepping θ_i with
gradient d_i = θ_i − x_i, which is how it runs here; any torch optimizer (Adam, for an adaptive
outer step) may take its place. On the complete topology x_i = mean_j z_j (one all-reduce) and the
whole update is DiLoCo with outer SGD(lr=η, momentum=γ, Nesterov).

**Two forms** (``momentum_on``). The above, momentum on the mixed iterates x, is ``"mixed"`` (the
default). ``"sent"`` is the update as a public summary of the paper writes it (the "GASLoC" page of
the ``zij`` canon, citing arXiv 2606.11081), with heavy-ball momentum on the sent iterates y = z::

    θ_i ← x_i + γ·(z_i − y_prev_i);  y_prev_i ← z_i     # y_prev_i starts at θ_0, kept locally

Stacked over replicas that is θ_{t+1} = y_t − α·Λ_t·y_t + γ·(y_t − y_{t−1}), Λ_t the round's graph
Laplacian with weight 1 on each edge of the matching (so that (I − α·Λ_t)·y is exactly the mix above).
The same z travels. It runs as plain SGD(lr=1) stepping θ_i with d_i = θ_i − x_i, then the momentum
term, so that with γ = 0 both forms are bitwise the same; a custom ``outer_optimizer`` has no place in
it and is refused. docs/algorithms.md derives which identities each form keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_loco.algorithms.base import OuterAlgorithm, OuterState, check_momentum, check_positive
from lightning_loco.algorithms.defaults import GASLOC
from lightning_loco.algorithms.outer_optimizer import (
    OptimizerOuterState,
    OuterOptimizerFactory,
    SGDFactory,
    anchor_fields,
    check_factory,
)
from lightning_loco.algorithms.schedules import (
    Round,
    everyone,
    exponential_matching,
    is_power_of_two,
    random_matching,
    ring_matching,
)

TOPOLOGIES = ("random_pairs", "ring", "exponential", "complete")
# Where the outer momentum γ acts: "mixed", on the mixed iterates x (our reconstruction, the default);
# "sent", on the sent iterates y = z (the form of the public summary of the paper).
MOMENTUM_ON = ("mixed", "sent")


def check_momentum_on(momentum_on: Any) -> None:
    """Raises ``ValueError`` naming the allowed values."""
    if momentum_on not in MOMENTUM_ON:
        raise ValueError(
            f"momentum_on must be 'mixed' (the default: momentum on the mixed iterates x, our reconstruction) "
            f"or 'sent' (heavy-ball momentum on the sent iterates y = z, as the public summary of the paper "
            f"writes GASLoC), got {momentum_on!r}."
        )


def _form(sent: bool) -> str:
    return "momentum_on='sent'" if sent else "momentum_on='mixed'"


# The largest outer momentum γ that our pure-consensus simulation found stable on each topology,
# for gossip_step α ≤ ¼ and for α ≤ ½ (``benchmarks/gasloc_consensus.py``, N = 16 to 1024; the table
# is in docs/benchmarks.md). Above these, replicas drift apart instead of agreeing.
STABLE_MOMENTUM = {"random_pairs": (0.95, 0.7), "ring": (0.95, 0.95), "exponential": (0.8, 0.5)}
# The same for momentum_on="sent" (``--forms``, N = 16 to 64; the table is in docs/algorithms.md):
# heavy ball on the sent iterates tolerates less momentum on random matchings and exponential rounds.
# On random pairs with α = ½ it stayed stable at γ = 0.7 but ever slower with N, hence 0.6.
STABLE_MOMENTUM_SENT = {"random_pairs": (0.8, 0.6), "ring": (0.95, 0.95), "exponential": (0.6, 0.5)}


def stability_note(topology: str, gossip_step: float, outer_momentum: Optional[float],
                   momentum_on: str = GASLOC.momentum_on) -> Optional[str]:
    """A warning text if (α, γ) lies outside what our consensus simulation found stable for this form,
    else None. ``outer_momentum`` None means a custom outer optimizer, for which γ means nothing: only α
    is checked then."""
    if topology == "complete":
        return None  # an exact average: stable for any momentum < 1 (DiLoCo's, in the "mixed" form)
    quarter, half = (STABLE_MOMENTUM_SENT if momentum_on == "sent" else STABLE_MOMENTUM)[topology]
    limit = quarter if gossip_step <= 0.25 else half
    untested = gossip_step > 0.5
    if not untested and (outer_momentum is None or outer_momentum <= limit):
        return None
    momentum = "" if outer_momentum is None else f" and outer_momentum γ={outer_momentum}"
    form = "" if momentum_on == "mixed" else f" ({_form(True)})"
    return (
        f"GASLoC{form} with topology={topology!r}, gossip_step α={gossip_step}{momentum} "
        + ("is outside the range we simulated (α ≤ ½)" if untested else f"exceeds the largest γ ({limit}) "
           "that stayed stable in our consensus simulation for this α")
        + "; replicas may drift apart. See docs/algorithms.md (GASLoC defaults)."
    )


@dataclass
class GASLoCState(OptimizerOuterState):
    """θ_i (the anchor), d_i = θ_i − x_i, the outer optimizer (holding x_prev implicitly in the
    "mixed" form), this round's z_i between ``payload`` and ``apply`` (saved with the state while a
    round is in flight) and, in the "sent" form only, y_prev_i: the z_i this replica sent last."""

    z: Optional[Tensor] = None
    y_prev: Optional[Tensor] = None

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.z is not None:
            out["z"] = self.z
        if self.y_prev is not None:
            out["y_prev"] = self.y_prev
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises ``ValueError`` (changing nothing) for a state saved by the other form."""
        saved_sent, sent = "y_prev" in state_dict, self.y_prev is not None
        if saved_sent != sent:
            raise ValueError(
                f"This GASLoC outer state was saved with {_form(saved_sent)} and cannot resume with "
                f"{_form(sent)}: the two keep different momentum state. Resume with {_form(saved_sent)}, or "
                "start a new run from the checkpoint's model weights."
            )
        super().load_state_dict(state_dict)
        z = state_dict.get("z")
        self.z = None if z is None else z.to(device=self.anchor.device, dtype=self.anchor.dtype).clone()
        if self.y_prev is not None:
            self.y_prev.copy_(state_dict["y_prev"])


class GASLoC(OuterAlgorithm):
    """GASLoC's outer step (our reconstruction; see the module docstring).

    Args:
        outer_lr: η, the step along the pseudo-gradient before mixing.
        outer_momentum: γ, the extrapolation (momentum) of the default outer SGD. Not used (nor checked)
            when ``outer_optimizer`` is given.
        gossip_step: α, in (0, 1]; with one peer, ½ is an exact pair average.
        topology: "random_pairs", "ring", "exponential" (N a power of two) or "complete".
        seed: seeds the random matchings (with the outer-step index).
        outer_optimizer: builds any torch optimizer over the anchor, stepped with d = θ − x; replaces
            the default SGD(lr=1, momentum=γ, nesterov=True). "mixed" form only.
        momentum_on: "mixed" (default): θ ← x + γ·(x − x_prev), our reconstruction; "sent":
            θ ← x + γ·(z − z_prev), the public summary's form (see the module docstring).
    """

    name = "gasloc"

    def __init__(
        self,
        outer_lr: float = GASLOC.outer_lr,
        outer_momentum: float = GASLOC.outer_momentum,
        gossip_step: float = GASLOC.gossip_step,
        topology: str = GASLOC.topology,
        seed: int = GASLOC.seed,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        momentum_on: str = GASLOC.momentum_on,
    ) -> None:
        check_momentum_on(momentum_on)
        check_factory(outer_optimizer)
        check_positive("outer_lr (η)", outer_lr, GASLOC.outer_lr)  # η is used with any outer optimizer (z = θ + η·g)
        if outer_optimizer is None:  # γ only configures the default SGD, as in DiLoCo
            check_momentum("outer_momentum (γ)", outer_momentum, GASLOC.outer_momentum)
        if not 0 < gossip_step <= 1:
            raise ValueError(
                f"gossip_step (α) must be in (0, 1], got {gossip_step}. "
                "½ averages a pair exactly; smaller values mix more gently."
            )
        if topology not in TOPOLOGIES:
            raise ValueError(f"Unknown topology {topology!r}. Use one of {', '.join(map(repr, TOPOLOGIES))}.")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.gossip_step = float(gossip_step)
        self.topology = topology
        self.collective = topology == "complete"  # x = mean z: one all-reduce
        self.seeded_schedule = topology == "random_pairs"
        self.any_replica_count = topology != "exponential"  # hypercube rounds need a power of two
        self.seed = int(seed)
        self.momentum_on = momentum_on
        self.custom_outer_optimizer = outer_optimizer is not None
        if momentum_on == "sent":  # θ ← θ − (θ − x), then + γ·(z − z_prev): see _extrapolate
            self.outer_optimizer: OuterOptimizerFactory = SGDFactory(1.0, 0.0, nesterov=False)
        else:
            self.outer_optimizer = outer_optimizer or SGDFactory(1.0, self.outer_momentum, nesterov=True)

    def keeps_paper_outer_step(self) -> bool:
        default_optimizer = self.sent or self.outer_optimizer == SGDFactory(1.0, self.outer_momentum, True)
        paper = (GASLOC.outer_lr, GASLOC.outer_momentum, GASLOC.gossip_step)
        return default_optimizer and (self.outer_lr, self.outer_momentum, self.gossip_step) == paper

    @property
    def sent(self) -> bool:
        """Whether the momentum acts on the sent iterates (``momentum_on="sent"``)."""
        return self.momentum_on == "sent"

    def check_num_replicas(self, num_replicas: int) -> None:
        if self.topology == "exponential" and not is_power_of_two(num_replicas):
            raise ValueError(
                f"topology='exponential' needs a power-of-two number of replicas, got {num_replicas}. "
                "Use 2, 4, 8, ... replicas, or topology='random_pairs' or 'ring'."
            )

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        if self.topology == "random_pairs":
            return random_matching(num_replicas, self.seed, outer_step)
        if self.topology == "ring":
            return ring_matching(num_replicas, outer_step)
        if self.topology == "exponential":
            return exponential_matching(num_replicas, outer_step)
        return everyone(num_replicas)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> GASLoCState:
        fields = anchor_fields(weights, shapes, self.outer_optimizer)
        y_prev = fields["anchor"].clone() if self.sent else None  # y_{−1} = θ_0: no momentum at the first step
        return GASLoCState(**fields, y_prev=y_prev)

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        assert isinstance(state, GASLoCState)
        state.z = torch.lerp(state.anchor, weights, self.outer_lr)  # z = θ + η·(θ_H − θ)
        if self.sent and self.topology == "complete":
            return state.z.clone()  # the all-reduce sums in place, and apply still needs this replica's own z
        return state.z

    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        """The step with x = z_i (no mixing), on a copy: "mixed" with the default SGD,
        z_i + γ·(z_i − x_prev_i) (another outer optimizer: its step with d = θ − z_i); "sent",
        z_i + γ·(z_i − y_prev_i)."""
        assert isinstance(state, GASLoCState)
        shadow = GASLoCState(**state.shadow(self.outer_optimizer), y_prev=state.y_prev)  # y_prev: read only
        z = torch.lerp(state.anchor, weights, self.outer_lr)
        return self._extrapolate(shadow, z, z)

    def _extrapolate(self, state: GASLoCState, x: Tensor, z: Tensor) -> Tensor:
        """The outer optimizer's step on θ with d = θ − x; in the "sent" form plus γ·(z − y_prev).
        Updates ``state.anchor`` (returned) and the optimizer, not ``y_prev``."""
        torch.sub(state.anchor, x, out=state.gradient)  # d = θ − x
        new = state.step()
        if self.sent and self.outer_momentum > 0:
            assert state.y_prev is not None
            new.add_(z - state.y_prev, alpha=self.outer_momentum)
        return new

    def _gossip(self, z: Tensor, group_sum: Tensor, group_size: int) -> Tensor:
        """x = z − α·Σ_j (z − z_j) = α·S + (1 − α·|G|)·z, with S the group's sum including z (a new tensor)."""
        return z.mul(1 - self.gossip_step * group_size).add_(group_sum, alpha=self.gossip_step)

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        """x_i, the gossip mix, without the extrapolation (γ·(x_i − x_prev_i), γ·(z_i − y_prev_i) or
        another outer optimizer's step)."""
        assert isinstance(state, GASLoCState) and state.z is not None
        if self.topology == "complete":
            return group_sum / group_size
        return self._gossip(state.z, group_sum, group_size)

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        assert isinstance(state, GASLoCState) and state.z is not None
        if self.topology == "complete":
            # The all-reduce may have summed into the payload: in the "mixed" form that is z, not needed
            # here; the "sent" form sent a copy and keeps z for its momentum.
            x = group_sum.div_(group_size)
        else:
            x = self._gossip(state.z, group_sum, group_size)
        z, state.z = state.z, None
        new = self._extrapolate(state, x, z)
        if state.y_prev is not None:
            state.y_prev.copy_(z)  # a copy: z may still be a buffer a peer reads
        return new


# ---------------------------------------------------------------- GASLoC's arguments that do not go together
# (each a rule of lightning_loco.rules, which names and documents it; None: the arguments are fine)


def momentum_beside_optimizer(a: GASLoC) -> Optional[str]:
    """``outer_momentum`` changed beside an ``outer_optimizer``, which replaces the SGD it configures."""
    if not a.custom_outer_optimizer or a.outer_momentum == GASLOC.outer_momentum:
        return None
    return (f"outer_momentum={a.outer_momentum!r} configures GASLoC's default outer SGD (lr 1, Nesterov momentum γ), "
            "which outer_optimizer replaces. Give the outer optimizer its own momentum, or drop outer_optimizer.")


def sent_with_optimizer(a: GASLoC) -> Optional[str]:
    """``momentum_on='sent'`` with an ``outer_optimizer``: that form has no place for one."""
    if not a.sent or not a.custom_outer_optimizer:
        return None
    return ("outer_optimizer with momentum_on='sent': that form puts the momentum γ·(z − z_prev) on the sent "
            "iterates, outside any optimizer, and the summary it follows defines no place for another outer "
            "optimizer. Use momentum_on='mixed' (the default) with outer_optimizer, or drop outer_optimizer.")


def gossip_step_without_matchings(a: GASLoC) -> Optional[str]:
    """``gossip_step`` changed on the complete topology, which averages everyone exactly."""
    if a.topology != "complete" or a.gossip_step == GASLOC.gossip_step:
        return None
    return (f"gossip_step={a.gossip_step!r} sets how far a replica moves towards its peer in a matching, and "
            "topology='complete' averages everyone exactly (x = mean z). Use a matching topology with it, or leave "
            "gossip_step at its default.")


def seed_without_draws(a: GASLoC) -> Optional[str]:
    """``seed`` changed with a topology that draws nothing."""
    if a.seeded_schedule or a.seed == GASLOC.seed:
        return None
    return (f"seed={a.seed} draws GASLoC's random matchings, and topology={a.topology!r} is the same every run. Use "
            f"topology='random_pairs' with it, or leave seed at {GASLOC.seed}.")
