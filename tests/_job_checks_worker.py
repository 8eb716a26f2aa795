"""What tests/test_job_checks.py runs in each process of a 2-process `st.launch` job: arguments that
disagree across the processes (issue 35) must raise a clear error in every process, never hang or abort."""

import datetime

import torch
import torch.distributed as dist

import shardtensor as st
from shardtensor.distributed import agreement


def _init_error(**kwargs) -> str | None:
    try:
        dist.init_process_group("shardtensor", timeout=datetime.timedelta(seconds=60), **kwargs)
    except ValueError as error:
        return str(error)
    return None


def disagreements(index: int) -> dict:
    report: dict = {
        "world_3": _init_error(world_size=3),  # a job of 2: torch's store waited for a third for ever
        "both_rank_0": _init_error(rank=0),  # process 1 too: EADDRINUSE
        "initialized_after": dist.is_initialized(),
    }
    report["good_init"] = _init_error()  # then a right one works
    dist.destroy_process_group()
    report["shape"] = _all_reduce_error(torch.ones(2 + index).to(st.device()))  # gloo aborted process 0
    report["dtype"] = _all_reduce_error(torch.ones(2, dtype=torch.float32 if index else torch.int32).to(st.device()))
    x = torch.arange(4.0) * (index + 1)
    report["sums"] = [st.all_reduce(st.REDUCE_SUM, x.to(st.device())).cpu() for _ in range(3)]
    report["agreed"] = len(agreement._AGREED)  # the loop's signature exchanged once
    return report


def _all_reduce_error(t) -> str | None:
    try:
        st.all_reduce(st.REDUCE_SUM, t).cpu()
    except ValueError as error:
        return str(error)
    return None
