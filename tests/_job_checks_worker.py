"""What tests/test_job_checks.py runs in each process of a 2-process `st.launch` job: arguments that
disagree across the processes (issue 35) must raise a clear error in every process, never hang or abort."""

import datetime

import torch.distributed as dist


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
    return report
