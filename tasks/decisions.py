"""Is a new plan worth the switch? The flow's view of `sailor_core.decisions`.

Contract: re-exports the pure decision (`decide_switch`, `PlanCost`, `SwitchDecision`) from
sailor_core, so the replan subflow and `sailor replay` (sailor_core.replay) run the same function.
"""

from sailor_core.decisions import PlanCost, SwitchDecision, decide_switch

__all__ = ["PlanCost", "SwitchDecision", "decide_switch"]
