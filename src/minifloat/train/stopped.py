"""What a run that stopped in the middle of its loop tells its user: where to continue from.

The first SIGINT/SIGTERM stops a run cleanly, with a checkpoint (signals.py), and a checkpoint
that cannot be written says so itself (checkpointer.py). Whatever else ends the loop (a second
Ctrl-C, which acts at once; an error in a step) leaves the newest checkpoint as it was, and
:func:`stop_handling` names that checkpoint in the exception.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

from minifloat.train.checkpointer import Checkpointer
from minifloat.train.errors import RunFailed, TrainingInterrupted
from minifloat.train.signals import StopSignals

if TYPE_CHECKING:
    from minifloat.train.trainer import Trainer

__all__ = ["explain_stop", "stop_handling"]


@contextlib.contextmanager
def stop_handling(trainer: Trainer) -> Iterator[StopSignals]:
    """Around the training loop: SIGINT/SIGTERM recorded (signals.py, the loop stops after the
    step), and what ends the loop otherwise raised as :func:`explain_stop` makes it."""
    try:
        with StopSignals() as signals:
            yield signals
    except BaseException as exc:
        explained = explain_stop(exc, step=trainer.step, checkpointer=trainer.checkpointer,
                                 saves=trainer.config.save_checkpoints)  # fmt: skip
        if explained is exc:
            raise
        raise explained from exc


def explain_stop(
    exc: BaseException, *, step: int, checkpointer: Checkpointer, saves: bool
) -> BaseException:
    """The exception to raise for ``exc``, which ended the loop after ``step`` steps.

    A KeyboardInterrupt (a second Ctrl-C) becomes a :class:`TrainingInterrupted` naming the
    newest checkpoint; any other error gets a note naming it (shown under its traceback, and
    on the CLI's one-line error). A clean stop and a failed run (:class:`RunFailed`, which
    says what to change) pass unchanged, and so does anything that is not an error.
    """
    if isinstance(exc, TrainingInterrupted | RunFailed) or not isinstance(
        exc, Exception | KeyboardInterrupt
    ):
        return exc
    if saves:
        where, newest = checkpointer.describe_newest()
    else:
        where, newest = "this run saves no checkpoints", None
    if isinstance(exc, KeyboardInterrupt):  # the CLI adds how to continue, as for the first
        message = f"interrupted by a second SIGINT after step {step}; {where}"
        return TrainingInterrupted(signal.SIGINT, step, newest, message=message)
    hint = f"{checkpointer.resume_hint()} once the cause is fixed" if saves else where
    exc.add_note(f"minifloat: the run stopped after step {step}; {hint}")
    return exc
