"""Stop a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what schedulers and ``kill`` send).

While a :class:`StopSignals` block is active, the first of these signals only records a request;
the trainer finishes the step it is in, writes a checkpoint and stops. A second signal acts as it
would without this block (SIGINT raises KeyboardInterrupt, SIGTERM terminates), for when the
checkpoint itself hangs. The handlers are process-wide, so they are installed only for the block,
only from the main thread (the only one Python delivers signals to), and restored afterwards.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager recording the first SIGINT/SIGTERM in :attr:`received` (None: none)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            return
        self._restore()  # the second signal: do what the previous handler does
        previous = signal.getsignal(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.raise_signal(signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._restore()
