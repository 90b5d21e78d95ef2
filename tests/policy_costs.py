"""Step costs the policy tests inject (``shared.spec.policy.StepCost``)."""

from __future__ import annotations


class Rotating:
    """Costs that make the next entry of ``order`` the fastest at each decision (a shape's name; None: a plain
    step)."""

    def __init__(self, order: list[str | None]):
        self.order, self.turn = order, 0

    def spec_s(self, batch, shape):
        return 0.5 if shape == self.order[self.turn % len(self.order)] else 100.0

    def decode_s(self, batch):  # asked once per decision, after every shape's cost
        self.turn += 1
        return 1.0
