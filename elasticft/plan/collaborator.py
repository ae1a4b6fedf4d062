"""Choosing the layout after every rendezvous round, in the agent.

After a round completes, the leader agent plans the layout for the round's membership (its node
count times this node's worker count) and publishes it in the round's store; every agent,
the leader included, reads that one published answer, so all workers of the round agree even if
agents were configured differently. Each agent then hands the layout to its workers as
environment variables (see :mod:`elasticft.plan.worker`).

Who leads is a strategy passed in (:data:`LeaderRule`): group rank 0 for now, a dedicated
leader election later. When planning fails (nothing fits on the nodes left), the leader
publishes the reason, every agent logs it, and workers get no layout variables.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from elasticft.addon.api import AddOn, AddOnContext, AgentCollaborator, GroupInfo, WorkerInfo
from elasticft.plan.api import Cluster, Hardware, Layout, ModelSpec, Pins, PlanError
from elasticft.plan.search import plan
from elasticft.plan.worker import layout_env

if TYPE_CHECKING:
    from elasticft.config import PlanConfig

logger = logging.getLogger(__name__)

LAYOUT_KEY = "elasticft/plan/layout"

LeaderRule = Callable[[GroupInfo], bool]


def group_rank_zero(group: GroupInfo) -> bool:
    """The interim leader: the agent with group rank 0 in this round."""
    return group.group_rank == 0


def layout_from_pins(pins: Pins, cluster: Cluster) -> Layout:
    """Without a model description: the pinned sizes, DP filling the rest, no accumulation."""
    tp, pp = pins.tp or 1, pins.pp or 1
    dp = pins.dp or cluster.gpus // (tp * pp)
    if dp < 1 or tp * pp * dp > cluster.gpus:
        raise PlanError(
            f"pinned layout TP{tp}xPP{pp}xDP{dp} needs {tp * pp * max(dp, 1)} GPUs, "
            f"{cluster.gpus} present",
            reason="no_valid_layout",
        )
    return Layout(tp=tp, pp=pp, dp=dp, grad_accum=1)


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What the leader plans with; model None means pins only."""

    model: ModelSpec | None
    hardware: Hardware
    pins: Pins = dataclasses.field(default_factory=Pins)


def choose_layout(inputs: PlanInputs, cluster: Cluster) -> dict[str, Any]:
    """The published record: the layout and its estimate, or the reason there is none."""
    try:
        if inputs.model is None:
            chosen = layout_from_pins(inputs.pins, cluster)
            return {"layout": dataclasses.asdict(chosen)}
        best = plan(inputs.model, inputs.hardware, cluster, inputs.pins, top=1).best
        return {
            "layout": dataclasses.asdict(best.layout),
            "estimate": dataclasses.asdict(best.estimate),
        }
    except PlanError as e:
        return {"error": str(e), "reason": e.reason}


class LayoutCollaborator(AgentCollaborator):
    """Plans (when leader) and distributes the layout of each rendezvous round."""

    def __init__(
        self,
        inputs: PlanInputs,
        *,
        is_leader: LeaderRule = group_rank_zero,
        wait_timeout: timedelta = timedelta(seconds=120),
    ) -> None:
        self.inputs = inputs
        self.is_leader = is_leader
        self.wait_timeout = wait_timeout
        self.layout: Layout | None = None
        """This round's layout (None before the first round or when planning failed)."""
        self.record: Mapping[str, Any] = {}

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self.layout = None
        cluster = Cluster(nodes=group.group_world_size, gpus_per_node=len(group.workers))
        if self.is_leader(group):
            record = choose_layout(self.inputs, cluster)
            store.set(LAYOUT_KEY, json.dumps(record, sort_keys=True))
        else:
            store.wait([LAYOUT_KEY], self.wait_timeout)
            record = json.loads(store.get(LAYOUT_KEY))
        self.record = record
        if "layout" in record:
            self.layout = Layout(**record["layout"])
            logger.info(
                "round %d layout on %d node(s) x %d: %s (estimate %s)",
                group.round, cluster.nodes, cluster.gpus_per_node, self.layout.describe(),
                record.get("estimate", {}).get("time_s", "n/a"),
            )
        else:
            logger.error("round %d has no layout: %s", group.round, record.get("error"))

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        return layout_env(self.layout) if self.layout is not None else {}


class LayoutAddOn(AddOn[LayoutCollaborator]):
    """The layout planner as an add-on of the agent (:class:`elasticft.addon.api.AddOn`)."""

    name: ClassVar[str] = "plan"

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> LayoutCollaborator | None:
        """Built from the plan options; None when neither a model nor a pin is given.

        Raises ConfigError (one line, naming the bad value) for an unusable model or hardware.
        """
        from elasticft.config import ConfigError

        try:
            return _from_options(context.options.plan)
        except PlanError as e:
            raise ConfigError(str(e), reason=e.reason) from None


def _from_options(plan_options: PlanConfig) -> LayoutCollaborator | None:
    from elasticft.plan.presets import load_hardware, load_model

    pinned = plan_options.layout
    pins = Pins(pinned.tp, pinned.pp, pinned.dp) if pinned is not None else Pins()
    if plan_options.plan_model is None and pins == Pins():
        return None
    hardware = load_hardware(plan_options.plan_hardware)
    if plan_options.plan_gpu_memory_gib is not None:
        hardware = dataclasses.replace(hardware, memory_gib=plan_options.plan_gpu_memory_gib)
    if plan_options.plan_probe:
        from elasticft.plan.probe import probed

        hardware = probed(hardware)
    model = load_model(plan_options.plan_model) if plan_options.plan_model else None
    return LayoutCollaborator(PlanInputs(model=model, hardware=hardware, pins=pins))
