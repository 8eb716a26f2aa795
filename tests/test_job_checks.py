"""Issue 35: in a job of several processes, arguments that disagree across the processes raise a
clear error in every process instead of hanging or aborting: ``dist.init_process_group`` with a
world size or rank that is not the job's (torch's store waited for ever, or EADDRINUSE). One small
`st.launch` job (1 device per process) runs every case."""

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
