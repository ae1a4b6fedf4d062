"""The agent's answer to a preemption notice: decide, save before the deadline, exit 75.

:class:`PreemptionHandler` is an agent collaborator (:class:`elasticft.addon.api.AddOn`).
Notices reach it from two places, and neither does any work where it arrives:

* the cloud watcher's threads (:class:`~elasticft.preemption.notices.CloudWatcher`), started
  when the add-on is built and never waited for;
* under Kubernetes (``KUBERNETES_SERVICE_HOST``), SIGTERM: the handler takes over torch's
  SIGTERM handler whenever workers start (torch installs its own at each start) and only
  records the notice, with the deadline the pod's grace period gives (``--preempt-grace-s``).
  A second SIGTERM goes to torch's handler and stops the run at once. Outside Kubernetes, and
  under Slurm (whose handler owns SIGTERM as a cancel), SIGTERM keeps torch's meaning.

In a job of several nodes, a node about to save and stop on its own termination notice first
leaves it in the round's store (:data:`PEER_NOTICE_KEY`); every other node looks there once a
poll interval and decides on it too: it goes on when the rendezvous can carry on without that
node (elastic, enough nodes left), and the departure is then a node loss like any other; else it
saves and stops at the same time, before the same deadline.

The work happens in :meth:`PreemptionHandler.check`, on the agent's monitor tick: one
``preemption_notice`` event, the pure decision (:func:`~elasticft.preemption.decision.decide`)
with its facts and reason as a ``preemption_decision`` event, the save through the one
"save before the deadline" path (:class:`elasticft.addon.savenow.SaveBeforeExit`) as a
``preemption_saved`` event (durable or not, the step, how long before the deadline), and the
end of the run: :class:`~elasticft.addon.api.StopRun` with state ``preempted`` and exit code
:data:`~elasticft.preemption.PREEMPTED_EXIT_CODE`. The agent then stops the workers; the
checkpoint service persists anything newer when it closes. A relaunch of the same command on
the same run directory (or with the same ``--ckpt-remote-dir``) resumes from the saved step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from elasticft.addon.api import (
    AddOn,
    AddOnContext,
    AgentCollaborator,
    GroupInfo,
    StopRun,
    run_ending_errors,
)
from elasticft.addon.savenow import CheckpointNow, SaveBeforeExit
from elasticft.config import PreemptConfig
from elasticft.events import EventLog
from elasticft.preemption import PREEMPTED_EXIT_CODE
from elasticft.preemption.decision import NoticeFacts, PlanAction, decide
from elasticft.preemption.notices import (
    CloudWatcher,
    Notice,
    cloud_sources,
    clouds_of,
    in_kubernetes,
    read_dmi,
)
from elasticft.steps import read_rank_steps

logger = logging.getLogger(__name__)

PEER_NOTICE_KEY = "elasticft/preemption/notice"
"""Where a preempted node tells the other nodes of its round (the round's store)."""


def _more_urgent(new: Notice, old: Notice | None) -> bool:
    """Whether ``new`` replaces the notice still waiting: a termination beats a rebalance,
    and of two terminations the earlier deadline wins."""
    if old is None:
        return True
    if new.kind != old.kind:
        return new.kind == "termination"
    return new.deadline is not None and (old.deadline is None or new.deadline < old.deadline)


@dataclasses.dataclass(eq=False)
class PreemptionHandler(AgentCollaborator):
    """Watches for preemption notices and acts on them (see the module docstring)."""

    config: PreemptConfig
    _: dataclasses.KW_ONLY
    saver: SaveBeforeExit
    events: EventLog | None = None
    watcher: CloudWatcher | None = None
    kubernetes: bool = False
    """Take SIGTERM as a notice with the pod's grace period."""
    elastic: bool = False
    """The rendezvous lets the job go on with fewer nodes (not the static one)."""
    min_nodes: int = 1
    node_id: str = ""
    wall_clock: Callable[[], float] = time.time
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._store: Any = None
        self._peer_heard = False
        self._peer_looked = float("-inf")
        self._lock = threading.Lock()
        self._pending: Notice | None = None
        self._torch_term_handler: Any = None
        self._term_at: float | None = None
        """When SIGTERM came (wall clock); the handler sets nothing else, takes no lock."""
        self._term_noted = False
        self.outcome: str | None = None

    # -- where notices arrive: record only --------------------------------------------------------

    def notify(self, notice: Notice) -> None:
        """Records a notice (from any thread but a signal handler's); ``check`` acts on it."""
        with self._lock:
            if _more_urgent(notice, self._pending):
                self._pending = notice

    def _on_term(self, signum: int, frame: Any) -> None:
        # Runs between bytecodes of the agent's main thread, maybe inside check() holding the
        # lock: note the time only, check() makes it a notice. A second SIGTERM is torch's
        # again: it stops the run at once.
        handler = self._torch_term_handler
        signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)
        if self._term_at is None:
            self._term_at = self.wall_clock()

    # -- hooks ----------------------------------------------------------------------------------

    def on_workers_started(self, group: GroupInfo) -> None:
        if not self.kubernetes or self._term_at is not None:
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is not self._on_term:
            self._torch_term_handler = current
            signal.signal(signal.SIGTERM, self._on_term)

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        # A new round's store: a notice another node left in an earlier round is not in it.
        self._store, self._peer_heard = store, False

    def _hear_peers(self, group: GroupInfo) -> None:
        """Another node's termination notice, left in the round's store (looked at once every
        poll interval: every node asks the same store)."""
        now = self.clock()
        if (self._store is None or self._peer_heard or group.group_world_size < 2
                or now - self._peer_looked < self.config.preempt_poll_s):
            return
        self._peer_looked = now
        try:
            if not self._store.check([PEER_NOTICE_KEY]):
                return
            told = json.loads(self._store.get(PEER_NOTICE_KEY))
        except run_ending_errors():
            raise
        except Exception:
            logger.debug("could not look for another node's preemption notice", exc_info=True)
            return
        self._peer_heard = True
        if told.get("node") != (self.node_id or group.node_id):
            self.notify(Notice(told.get("provider", "aws"), "termination", told.get("deadline"),
                               str(told.get("detail", "")), from_node=str(told.get("node"))))

    def _tell_peers(self, group: GroupInfo, notice: Notice) -> None:
        if self._store is None or group.group_world_size < 2 or notice.from_node:
            return
        self._peer_heard = True  # this node's own
        try:
            self._store.set(PEER_NOTICE_KEY, json.dumps({
                "node": self.node_id or group.node_id, "provider": notice.provider,
                "deadline": notice.deadline, "detail": notice.detail}))
        except run_ending_errors():
            raise
        except Exception as e:
            logger.warning("could not tell the other nodes of this preemption: %s", e)

    def check(self, group: GroupInfo) -> None:
        self._hear_peers(group)
        if self._term_at is not None and not self._term_noted:
            self._term_noted = True
            grace = self.config.preempt_grace_s
            self.notify(Notice("kubernetes", "termination", self._term_at + grace,
                               f"SIGTERM, termination grace period {grace:g} s"))
        with self._lock:
            notice, self._pending = self._pending, None
        if notice is not None and self.outcome is None:
            self._act(group, notice)
        return None

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()

    # -- acting ---------------------------------------------------------------------------------

    def _emit(self, kind: str, **payload: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **payload)

    def _facts(self, group: GroupInfo, notice: Notice, now: float) -> NoticeFacts:
        worker_api = self.saver.uses_worker_api(group)
        newest = durable = None
        service = self.saver.checkpointer
        if worker_api and service is not None:
            newest = getattr(service, "newest_common_step", lambda g: None)(group)
            durable = _durable_step(service)
        step_time, age = _step_timing(group, newest, now)
        return NoticeFacts(kind=notice.kind, seconds_left=notice.seconds_left(now),
                           worker_api=worker_api, newest_step=newest, durable_step=durable,
                           snapshot_age_s=age, step_time_s=step_time,
                           nodes=group.group_world_size, from_node=notice.from_node,
                           goes_on_without_it=self.elastic
                           and group.group_world_size - 1 >= max(self.min_nodes, 1))

    def _act(self, group: GroupInfo, notice: Notice) -> None:
        now = self.wall_clock()
        left = notice.seconds_left(now)
        logger.warning("preemption notice from %s%s: %s%s", notice.provider,
                       f" for node {notice.from_node}" if notice.from_node else "",
                       notice.detail, f" ({left:.0f} s left)" if left is not None else "")
        self._emit("preemption_notice", provider=notice.provider, notice=notice.kind,
                   detail=notice.detail, deadline=notice.deadline, seconds_left=left,
                   from_node=notice.from_node)
        facts = self._facts(group, notice, now)
        plan = decide(facts)
        logger.warning("preemption: %s", plan.reason)
        self._emit("preemption_decision", action=plan.action.value, reason=plan.reason,
                   save_budget_s=plan.save_budget_s, facts=dataclasses.asdict(facts))
        if plan.action is PlanAction.CONTINUE:
            return
        if plan.action in (PlanAction.SAVE_AND_STOP, PlanAction.STOP):
            self._tell_peers(group, notice)  # they save at the same time as this node
        saved = ""
        if plan.action in (PlanAction.SAVE_AND_STOP, PlanAction.PERSIST_AND_CONTINUE):
            saved = self._save(group, notice, plan.save_budget_s,
                               keep_training=plan.action is PlanAction.PERSIST_AND_CONTINUE)
        if plan.action is PlanAction.PERSIST_AND_CONTINUE:
            return
        self.outcome = "preempted"
        raise StopRun("preempted", f"preempted ({notice.provider}: {notice.detail}); {saved}",
                      exit_code=PREEMPTED_EXIT_CODE)

    def _save(self, group: GroupInfo, notice: Notice, budget_s: float, keep_training: bool
              ) -> str:
        started = self.clock()
        if keep_training:  # only the checkpoint service: a signal would end a plain script
            service = self.saver.checkpointer
            durable = service is not None and service.checkpoint_now("rebalance", budget_s)
            how = "checkpoint service acknowledged" if durable else "not persisted"
        else:
            durable, how = self.saver.save(group, started + budget_s, signal.SIGTERM,
                                           "preemption")
        took = self.clock() - started
        left = notice.seconds_left(self.wall_clock())
        step = _durable_step(self.saver.checkpointer) if durable else None
        self._emit("preemption_saved", provider=notice.provider, durable=durable, how=how,
                   step=step, duration_s=took, before_deadline_s=left)
        words = (f"checkpoint {'durable' if durable else 'NOT confirmed'}"
                 f"{f' at step {step}' if step is not None else ''} ({how}, {took:.1f} s"
                 f"{f', {left:.1f} s before the deadline' if left is not None else ''})")
        (logger.warning if durable else logger.error)("preemption: %s", words)
        return words


def _durable_step(service: CheckpointNow | None) -> int | None:
    """The checkpoint service's newest persisted step (None: none, or not known)."""
    persisted = getattr(getattr(service, "persister", None), "persisted", None)
    return persisted if isinstance(persisted, int) and persisted >= 0 else None


def _step_timing(group: GroupInfo, newest: int | None, now: float
                 ) -> tuple[float | None, float | None]:
    """(step time, age of the newest snapshot) from this node's first rank's step records."""
    ranks = [w.global_rank for w in group.workers]
    try:
        records = read_rank_steps(group.run_dir, min(ranks)) if ranks else []
    except OSError:
        return None, None
    recent = records[-6:]
    gaps = [b.time - a.time for a, b in itertools.pairwise(recent)
            if b.step == a.step + 1]
    step_time = statistics.median(gaps) if gaps else None
    taken = [r.time for r in records if r.step == newest] if newest is not None else []
    age = now - taken[-1] if taken else None
    return step_time, age


class PreemptionAddOn(AddOn[PreemptionHandler]):
    """The preemption handler as an add-on of the agent; None with ``--preempt-notices off``. It
    needs the checkpoint service (when there is one) for the save. Built on the main thread,
    where SIGTERM's handler can be installed."""

    name: ClassVar[str] = "preempt"
    needs: ClassVar[tuple[str, ...]] = ("ckpt", "slurm")

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> PreemptionHandler | None:
        config = context.options.preempt
        if config.preempt_notices == "off":
            return None
        service = built.get("ckpt")
        under_slurm = built.get("slurm") is not None  # Slurm's SIGTERM is a cancel
        launch = context.launch
        handler = PreemptionHandler(
            config,
            saver=SaveBeforeExit(service if isinstance(service, CheckpointNow) else None),
            events=context.events,
            kubernetes=in_kubernetes(context.env) and not under_slurm,
            elastic=getattr(launch, "rdzv_backend", "static") != "static",
            min_nodes=int(getattr(launch, "min_nodes", 1) or 1),
            node_id=context.options.agent.node_id or "",
        )
        named = config.preempt_notices != "auto"  # a URL: that server answers for all
        providers = ("aws", "gcp", "azure") if named else clouds_of(read_dmi())
        if not providers:
            logger.debug("preemption notices: not a cloud machine (by its DMI); no metadata "
                         "endpoint asked")
        handler.watcher = CloudWatcher(
            cloud_sources(*config.urls(), providers=providers),
            handler.notify, poll_s=config.preempt_poll_s,
            probe_timeout_s=config.preempt_probe_timeout_s)
        handler.watcher.start()
        if handler.kubernetes:
            logger.info("Kubernetes pod: SIGTERM is a preemption notice (save, stop, exit %d)",
                        PREEMPTED_EXIT_CODE)
        return handler
