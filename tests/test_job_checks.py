"""Issue 35: in a job of several processes, arguments that disagree across the processes raise a
clear error in every process instead of hanging or aborting: ``dist.init_process_group`` with a
world size or rank that is not the job's (torch's store waited for ever, or EADDRINUSE), and
``st.all_reduce`` of a different shape or dtype in each process (gloo ended process 0 by SIGABRT). One small
`st.launch` job (1 device per process) runs every case."""

import torch

import shardtensor as st
from _job_checks_worker import disagreements


def test_disagreements_across_processes_raise_in_every_process():
    job = st.launch(disagreements, nprocs=2, devices_per_process=1)
    for index, r in enumerate(job):
        assert f"this process is process {index} of a job of 2 processes" in r["world_3"], r["world_3"]
        assert "process 0: rank 0 of world size 3, process 1: rank 1 of world size 3" in r["world_3"]
        assert "process 0: rank 0 of world size 2, process 1: rank 0 of world size 2" in r["both_rank_0"]
        assert r["initialized_after"] is False
        assert r["good_init"] is None
        assert (
            "st.all_reduce: the processes passed different tensors (process 0: all_reduce((2,) torch.float32"
            in r["shape"]
        )
        assert "process 1: all_reduce((3,) torch.float32" in r["shape"]
        assert "process 0: all_reduce((2,) torch.int32" in r["dtype"] and "(2,) torch.float32" in r["dtype"]
        for got in r["sums"]:
            torch.testing.assert_close(got, torch.arange(4.0) * 3)
        assert r["agreed"] == 1
