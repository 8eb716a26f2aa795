"""Reading a run's check rows ends its watch in flight when it runs on one device.

A compiled call reads its run's check rows before it returns. On one device (one TPU chip) those
rows, a computed result, show the whole run finished without a failure, so the run is no longer in
flight and the next call has nothing to look at (``inflight.settle``); on several devices only one
device's copy of the rows was read, so the run stays until settled. Either way a failed check
raises on its call and the results equal eager torch's.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import reset_state
from shardtensor.graph import inflight

ONE_DEVICE = textwrap.dedent("""
    import os
    import torch, torch.nn.functional as F
    import shardtensor as st
    from shardtensor.graph import inflight

    EARLY = os.environ["SHARDTENSOR_EARLY_ROWS"] == "1"  # (the rows' own program first: the chip's path)

    w, ids = torch.randn(10, 4), torch.tensor([1, 2, 3])
    dw, dids = w.to(st.device()), ids.to(st.device())

    @st.compile
    def step(ids, w):
        return F.embedding(ids, w) * 2

    flights = []
    for _ in range(4):
        out = step(dids, dw)
        flights.append(inflight.in_flight())
    assert len(step._frozen) == 1, "the step froze"
    if not EARLY:  # (with early rows its own rows are read once ready: maybe at the next call)
        assert flights[1:] == [0, 0, 0], flights  # (its replays: read, so finished)
    assert torch.equal(out.cpu(), F.embedding(ids, w) * 2)
    try:
        step(torch.tensor([1, 12, 3]).to(st.device()), dw)
        raise AssertionError("a bad index did not raise on its call")
    except IndexError as error:
        assert "index out of range" in str(error)
    out = step(dids, dw)
    assert torch.equal(out.cpu(), F.embedding(ids, w) * 2)
    y = F.embedding(dids, dw) + 1  # (a lazy program's rows, read before its value)
    assert torch.equal(y.cpu(), F.embedding(ids, w) + 1)
    if not EARLY:
        assert inflight.in_flight() == 0
    print("ok")
""")


@pytest.mark.parametrize("early", ["0", "1"])
def test_one_device_runs_end_when_their_rows_are_read(early):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # (it may ask for 8 devices)
    env.update(SHARDTENSOR_CPU_DEVICES="1", SHARDTENSOR_PLATFORM="cpu", SHARDTENSOR_EARLY_ROWS=early)
    proc = subprocess.run([sys.executable, "-c", ONE_DEVICE], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_runs_on_several_devices_stay_in_flight_until_settled():
    reset_state()
    w, ids = torch.randn(10, 4), torch.tensor([1, 2, 3])
    dw, dids = w.to(st.device()), ids.to(st.device())

    @st.compile
    def step(ids, w):
        return F.embedding(ids, w) * 2

    for _ in range(3):
        out = step(dids, dw)
        assert inflight.in_flight() >= 1  # (one device's copy of its rows read: its run not yet looked at)
    assert torch.equal(out.cpu(), F.embedding(ids, w) * 2)
    assert inflight.in_flight() == 0  # (reading a value settles)
    reset_state()
