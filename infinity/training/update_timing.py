"""When optimizer updates run: in ``optimizer.step()`` or inside backward, as each gradient
completes (``step_in_backward``), and, with ``step_in_backward='auto'``, the choice between them.

Updating in backward overlaps the optimizer state's reads with backward and never holds every
gradient, but it is only the same arithmetic as the loop's own ``optimizer.step()`` when the
loop does nothing with the gradients between backward and step. What a loop does there is only
known once it runs, so 'auto' watches the first step (updates in ``optimizer.step()``) and
switches from the second if, between its first gradient and ``optimizer.step()`` (the
*window*), the loop

* ran one backward pass (no gradient accumulation, no second loss),
* used no ``p.grad`` (clipping, norm logging, ``clip_grad_value_``, edits),
* kept the hyper-parameters in ``param_groups`` (no learning rate set after backward),
* used nothing else of the model (no forward, no read of a parameter, no checkpoint or state
  dict), which would see the parameters before their update,

and it cleared the gradients (``zero_grad``, ``p.grad = None``) before the next backward began;
the config must allow it at all (no gradient clipping or fp16 loss scaling, which need every
gradient first). That last check runs at the second step's first gradient, before any update in
backward, so a loop that keeps gradients across steps from the start never leaves
``optimizer.step()``. (One that stops clearing later goes unseen: with updates in backward no
gradient is left after a step for it to clear.)

Across ranks an update runs once the reduction of its gradient's bucket has landed. The choice
between the modes is each rank's, which is safe because an update starts no collective: the
persistent device copies it makes stale come back in ``optimizer.step()``.

A loop that changes later cannot be undone for the step where it shows: those gradients were
applied already. Each such change is logged as a warning, saying what it cost, and updates go
back to ``optimizer.step()`` for good; a second backward is refused before its gradient is
used (``Stepping.grad_arriving``), since summing it into an update already applied has no
right answer.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

import torch

from infinity.core.disk_needs import release_gradient_space

if TYPE_CHECKING:
    from infinity.core.placement import Placement

log = logging.getLogger(__name__)


class UpdateMode(enum.Enum):
    IN_STEP = "in optimizer.step()"
    IN_BACKWARD = "in backward"
    #: 'auto' before its first step: updates in optimizer.step(), the loop watched
    WATCHING = "watching the first step"


def _hyper_parameters(optimizer: Any) -> list[dict[str, Any]]:
    """Every group's settings except its params, copied so later in-place edits show."""
    out = []
    for group in optimizer.param_groups:
        out.append(
            {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in group.items()
                if k != "params"
            }
        )
    return out


def _changed(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str | None:
    """The first difference between two snapshots, in words; None when they match."""
    if len(before) != len(after):
        return f"the optimizer went from {len(before)} to {len(after)} param_groups"
    for index, (old, new) in enumerate(zip(before, after)):
        for key in sorted(set(old) | set(new), key=str):
            a, b = old.get(key), new.get(key)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                same = (
                    isinstance(a, torch.Tensor)
                    and isinstance(b, torch.Tensor)
                    and a.shape == b.shape
                    and bool(torch.equal(a.cpu(), b.cpu()))
                )
            else:
                try:
                    same = bool(a == b)
                except Exception:  # a value that does not compare: assume it changed
                    same = False
            if not same:
                return f"param_groups[{index}][{key!r}] went from {a!r} to {b!r}"
    return None


def config_reasons(gradient_clipping: float, loss_scaling: bool) -> list[str]:
    """What in the config, besides the arena's size, keeps 'auto' from updating in backward,
    each with the way to lift it."""
    reasons = []
    if gradient_clipping:
        reasons.append(
            f"gradient_clipping={gradient_clipping:g} needs every gradient's norm first: set "
            f"gradient_clipping=0 to update in backward"
        )
    if loss_scaling:
        reasons.append(
            "fp16 loss scaling must see every gradient before it can skip a step: use "
            "precision.dtype='bf16' to update in backward"
        )
    return reasons


class UpdateTiming:
    """Where updates run, and the watch that chooses for 'auto'. The one owner of
    ``Placement.update_in_backward`` once an optimizer is attached.

    The store calls ``gradient_arriving`` before each gradient is taken, ``loop_acted`` when
    the loop uses the model or its gradients outside forward and backward,
    ``gradients_cleared`` on ``zero_grad``, and ``step_starts`` / ``step_ends`` around
    ``optimizer.step()``.
    """

    def __init__(
        self,
        setting: bool | str,
        reasons_against: list[str],
        placement: Placement,
        warn: bool = False,
    ) -> None:
        """``reasons_against``: why the config keeps 'auto' from updating in backward (empty:
        it may), each with the way to lift it; ``warn``: one of them is a sizing the user may
        not know costs every step's gradients a write and a read (logged as a warning)."""
        self.auto = setting == "auto"
        self.placement = placement
        #: why updates run in optimizer.step() now, each with the way to lift it (empty in
        #: backward, or while the first step is watched); stats()['update_mode_reasons']
        self.reasons: list[str] = []
        #: what the loop did that keeps updates in optimizer.step() (in the watched first
        #: step, or a change after the switch), each as in ``reasons``; empty while the
        #: watched loop allows updates in backward; None when no step was watched ('auto'
        #: with the config against it from the start, or True / False): how the loop behaves
        #: is then unknown. A prediction for another config replays it (infinity.planning).
        self.loop_reasons: list[str] | None = None
        if setting is True:
            mode = UpdateMode.IN_BACKWARD
        elif self.auto and not reasons_against:
            mode = UpdateMode.WATCHING
        else:
            mode = UpdateMode.IN_STEP
            if self.auto:
                self.reasons = list(reasons_against)
                log.log(
                    logging.WARNING if warn else logging.INFO,
                    "step_in_backward='auto': updates run in optimizer.step() (%s)",
                    "; ".join(reasons_against),
                )
            else:
                self.reasons = ["step_in_backward=False: set it to 'auto' or True"]
        self._set(mode)
        self._backwards_at_step = 0
        #: the window is open (a gradient arrived since the last step): its hyper-parameters
        self._hyper_at_backward: list[dict[str, Any]] | None = None
        #: what the loop did in the window that updates in backward would change
        self._acts: list[str] = []
        #: the gradients were cleared since the last step (or no step ran yet)
        self._cleared = True
        #: switched into backward at the last step: confirmed by the next window's start
        self._confirming = False
        #: where the watched step sends the next ones
        self._next = UpdateMode.IN_STEP
        self._warned_no_room = False

    @property
    def in_backward(self) -> bool:
        return self.mode is UpdateMode.IN_BACKWARD

    def _set(self, mode: UpdateMode) -> None:
        self.mode = mode
        self.placement.phase.set_update_in_backward(mode is UpdateMode.IN_BACKWARD)

    def _loop_keeps_step(self, reasons: list[str]) -> None:
        """The loop does what updates in backward cannot follow: in optimizer.step() for good."""
        self.reasons = reasons
        self.loop_reasons = list(reasons)
        self._set(UpdateMode.IN_STEP)

    def _give_up(self, what: str, cost: str) -> None:
        """A change after the switch: say what it cost, and update in optimizer.step() from
        now on."""
        log.warning(
            "step_in_backward='auto': %s, which the first step did not do; this step's "
            "updates already ran in backward, so %s. Updates run in optimizer.step() "
            "from now on; set step_in_backward=False to keep them there from the start",
            what,
            cost,
        )
        self._loop_keeps_step([f"{what} after updates had moved into backward"])

    # -- what the loop does ---------------------------------------------------------------------
    def gradient_arriving(self, optimizer: Any) -> None:
        if self._hyper_at_backward is not None or self.mode is UpdateMode.IN_STEP:
            return
        if self._confirming and not self._cleared:
            # Checked once: after the switch no gradient is left after a step for the loop to
            # clear, so model.zero_grad() finds nothing to set to None.
            log.info(
                "step_in_backward='auto': updates stay in optimizer.step(): the loop keeps "
                "gradients across optimizer.step() (no zero_grad before this backward), "
                "which plain PyTorch adds to the next ones"
            )
            self._loop_keeps_step(
                [
                    "the loop keeps gradients across optimizer.step() (no zero_grad() before "
                    "the next backward): clear them after each step"
                ]
            )
            self._confirming = False
            return
        self._confirming = False
        self._hyper_at_backward = _hyper_parameters(optimizer)

    def loop_acted(self, what: str, grads: bool = False) -> None:
        """The loop did ``what`` (used ``p.grad`` when ``grads``) outside forward and backward;
        only the window's acts count."""
        if self._hyper_at_backward is None:
            return
        if self.mode is UpdateMode.WATCHING:
            if what not in self._acts:
                self._acts.append(what)
        elif self.auto and self.in_backward:
            cost = (
                "p.grad is None where a gradient was consumed (clip_grad_norm_ clipped "
                "nothing this step)"
                if grads
                else "it saw the parameters after this step's update, not before"
            )
            self._give_up(f"{what} between backward and optimizer.step()", cost)

    def gradients_cleared(self, updates_applied: int) -> None:
        """``zero_grad()``; ``updates_applied``: updates this window ran in backward (their
        gradients are gone; a window cleared before its step discards what it had)."""
        self._cleared = True
        if self._hyper_at_backward is None:
            return
        if self.mode is UpdateMode.WATCHING:
            self._acts.append("zero_grad() before optimizer.step()")
        elif self.auto and self.in_backward and updates_applied:
            self._give_up(
                "the gradients were cleared before optimizer.step() (a backward that "
                "raised, a skipped batch)",
                f"the updates of {updates_applied} "
                f"parameters stay applied where plain PyTorch would drop them",
            )
            self._hyper_at_backward = None

    def no_room(self, name: str, why: str, for_good: bool = True) -> None:
        """An update in backward found no room in the arena next to what backward holds.
        ``for_good``: updates run in ``optimizer.step()`` from now on; otherwise only this
        one waits for it (across ranks, where the mode must stay the same on every rank and
        the arena is each rank's own)."""
        if not for_good:
            if not self._warned_no_room:
                log.info(
                    "step_in_backward='auto': the update of %s in backward found no room "
                    "(%s): it runs in optimizer.step(), as will any other that finds none "
                    "(further ones at debug level)",
                    name,
                    why,
                )
                self._warned_no_room = True
            else:
                log.debug("the update of %s in backward found no room: in the step", name)
            return
        log.info(
            "step_in_backward='auto': the update of %s in backward found no room (%s): it "
            "and the ones after it run in optimizer.step(), with the whole arena, from now "
            "on",
            name,
            why,
        )
        self.reasons = [f"the update of {name} in backward found no room ({why})"]
        self._set(UpdateMode.IN_STEP)

    def second_backward_message(self, name: str) -> str:
        if self.auto:
            return (
                f"step_in_backward='auto' runs updates in backward since the first step had "
                f"one backward per optimizer.step(), and the previous backward already "
                f"applied the update of {name}; this backward before optimizer.step() "
                f"(gradient accumulation, a second loss) cannot be added to it. Set "
                f"step_in_backward=False for this loop"
            )
        return (
            f"step_in_backward=True: the previous backward already applied the update of "
            f"{name}, and optimizer.step() was not called since. This mode needs exactly "
            f"one backward per optimizer.step() (no gradient accumulation, no backward whose "
            f"gradients are discarded): call optimizer.step() after each backward, or set "
            f"step_in_backward=False"
        )

    def refused_second_backward(self) -> None:
        if self.auto:
            self._loop_keeps_step(
                [
                    "a second backward before optimizer.step() (gradient accumulation, a "
                    "second loss): set step_in_backward=False for this loop"
                ]
            )

    # -- the step -------------------------------------------------------------------------------
    def step_starts(self, backward_passes: int, optimizer: Any) -> None:
        passes = backward_passes - self._backwards_at_step
        self._backwards_at_step = backward_passes
        change = None
        if self._hyper_at_backward is not None:
            change = _changed(self._hyper_at_backward, _hyper_parameters(optimizer))
        if self.mode is UpdateMode.WATCHING:
            against = list(self._acts)
            if passes != 1:
                against.insert(0, f"{passes} backward passes (gradient accumulation?)")
            if change:
                against.append(f"{change}")
            if against:
                log.info(
                    "step_in_backward='auto': updates stay in optimizer.step(): between "
                    "the first step's backward and optimizer.step() the loop did: %s",
                    "; ".join(against),
                )
                self.reasons = [
                    f"between the first step's backward and optimizer.step() the loop did: {act}"
                    for act in against
                ]
                self.loop_reasons = list(self.reasons)
                self._next = UpdateMode.IN_STEP
            else:
                log.info(
                    "step_in_backward='auto': the first step had one backward and used "
                    "nothing between it and optimizer.step(): updates run in backward "
                    "from the next step, once its backward starts after zero_grad"
                )
                self.loop_reasons = []
                self._next = UpdateMode.IN_BACKWARD
        elif self.auto and self.in_backward and change:
            self._give_up(
                f"{change} between backward and optimizer.step()",
                "they used the values before the change",
            )

    def step_ends(self) -> None:
        if self.mode is UpdateMode.WATCHING:
            self._set(self._next)
            self._confirming = self.in_backward
            if self.in_backward:
                # The first step's gradients were the last the disk holds: their space goes.
                freed = release_gradient_space(self.placement.registry, self.placement.engine)
                log.debug("updates in backward: %d bytes of gradient extents freed", freed)
        self._hyper_at_backward = None
        self._acts = []
        self._cleared = False
