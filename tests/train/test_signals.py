"""Tests for minifloat.train.signals in this process (a whole run stopped by real signals is in
tests/train/test_faults.py)."""

from __future__ import annotations

import signal

import pytest

from minifloat.train.signals import StopSignals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_recorded_and_the_handlers_restored(signum: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals() as stop:
        assert stop.received is None
        signal.raise_signal(signum)  # delivered to this (main) thread before raise_signal returns
        assert stop.received == signum
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_sigint_interrupts_at_once() -> None:
    # Python's handler raises KeyboardInterrupt; Python installs it at startup unless SIGINT was
    # ignored then (a process a non-interactive shell started in the background), so set it here.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.received == signal.SIGINT
            signal.raise_signal(signal.SIGINT)  # e.g. the checkpoint hangs: Ctrl-C again
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
