"""An aborted generation's model and optimizer live on only until the next generation has resumed from them.

One worker process's generations, in this process (a one-rank world over gloo, run on a thread so
that no signal handler is installed in the test runner): generation 0 is aborted after two steps as
a lost peer aborts it; its trainer, whole at step 2, is what the process keeps (the survivors'
memory), and the aborted generation keeps only its process groups. Generation 1 resumes from it
('memory') and, from then on, nothing holds the old trainer: its model and optimizer are freed
before generation 1 trains, and the losses go on as one uninterrupted run's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch.distributed as dist

from sailor_core.errors import PeerLost
from sailor_core.plan_format import plan_to_dict
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.notices import Notices
from sailor_core.runtime.worker_proc import Kept, _DataCache, run_generation
from tests.test_runtime import SINGLE

STEPS = 5


def _on_thread(fn: Any) -> tuple[Any, str | None]:
    """fn()'s result, or the name of the exception it raised (not the exception: its traceback would
    hold the frames, and with them the trainer)."""
    out: list[Any] = [None, None]

    def body() -> None:
        try:
            out[0] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by name
            out[1] = type(e).__name__

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=240)
    assert not t.is_alive(), "the generation did not end"
    return out[0], out[1]


def test_an_aborted_generation_is_freed_once_the_next_one_resumed():
    settings = {"model": "gpt-tiny", "steps": STEPS, "timeout_s": 30}
    assignment = {"plan": plan_to_dict(SINGLE), "settings": settings, "rank": 0, "world_size": 1, "resume": False}
    waiter, notices, kept, data = Waiter(abortable=True), Notices(), Kept(), _DataCache()
    graveyard: list[Any] = []
    losses: dict[int, float] = {}

    def abort_after_two(rec: dict[str, Any]) -> None:
        losses[rec["step"]] = rec["loss"]
        if rec["step"] == 2:
            waiter.abort.set()  # what the worker's watcher does when the controller reports a lost peer

    def generation(a: dict[str, Any], **kw: Any) -> Any:
        return run_generation(a, data=data, init={"store": dist.HashStore()}, kept=kept, graveyard=graveyard,
                              notices=notices, waiter=waiter, **kw)

    _, raised = _on_thread(lambda: generation(assignment, on_metrics=abort_after_two))
    assert raised == PeerLost.__name__
    assert all(isinstance(g, dist.ProcessGroup) for g in graveyard)  # groups only (none here: one rank)
    old = kept.trainer
    assert old is not None and old.step == 2 and old.consistent  # the survivors' memory
    model, opt = weakref.ref(old.model), weakref.ref(old.opt)
    del old

    waiter.abort.clear()
    seen: list[tuple[str, bool, bool]] = []
    status, raised = _on_thread(lambda: generation(
        {**assignment, "resume": True}, on_metrics=lambda rec: losses.__setitem__(rec["step"], rec["loss"]),
        on_loaded=lambda how: seen.append((how, model() is None, opt() is None))))
    assert (status, raised) == ("done", None)
    assert seen == [("memory", True, True)]  # resumed from it, then freed before training on
    assert kept.trainer is not None and kept.trainer.step == STEPS

    reference: dict[int, float] = {}
    fresh = Kept()
    status, raised = _on_thread(lambda: run_generation(
        assignment, data=data, init={"store": dist.HashStore()}, kept=fresh, notices=Notices(),
        on_metrics=lambda rec: reference.__setitem__(rec["step"], rec["loss"])))
    assert (status, raised) == ("done", None)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(abs(losses[k] - reference[k]) for k in reference) < 1e-6, (losses, reference)
