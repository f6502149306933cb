"""The one stop handler every target's controller runs under (run/stopper.stop_on_signals): Ctrl-C and
SIGTERM both turn into the stop request, real signals to this very process; `harness stop`'s marker then
tells a stop from an interrupt. The integration tests stop one real run per target through it."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from harness.control.results import stopped_status
from harness.control.stopper import stop_on_signals
from harness.record.rundir import RunDir
from harness.record.schema import RunStatus


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_are_one_stop_request_and_the_handlers_are_put_back(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = threading.Event()
    with stop_on_signals(stop):
        os.kill(os.getpid(), sig)
        assert stop.wait(5), f"{sig.name} did not ask for the stop"
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_handlers_are_put_back_when_the_run_fails() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), stop_on_signals(threading.Event()):
        raise RuntimeError("the controller failed")
    assert signal.getsignal(signal.SIGTERM) == before


def test_harness_stops_marker_makes_a_stop_and_its_absence_an_interrupt(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert stopped_status(run) is RunStatus.INTERRUPTED
    run.stop_marker.touch()
    assert stopped_status(run) is RunStatus.STOPPED
