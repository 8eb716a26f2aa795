"""One process of the two-process job of tests/test_multihost.py: ``python _multihost_worker.py PORT
PROCESS_ID TORCH_PORT CHECKPOINT_DIR``, with SHARDTENSOR_CPU_DEVICES=4. Prints one line
``REPORT <json>`` of what it saw; the test compares it with eager torch (computed there from the
same seeds)."""

import json
import os
import sys

import shardtensor.runtime as rt

port, pid, torch_port, checkpoint_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rt.initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402
from shardtensor.fsdp import FSDPv2  # noqa: E402

report = {
    "ids": [a["id"] for a in rt.global_runtime_device_attributes()],
    "names": [a["name"] for a in rt.global_runtime_device_attributes()],
    "owners": [a["process_index"] for a in rt.global_runtime_device_attributes()],
}
mesh = st.Mesh(range(8), (8,), ("fsdp",))
g = torch.Generator().manual_seed(0)
X = torch.randn(16, 6, generator=g)  # the same global tensor in both processes
W = torch.randn(6, 3, generator=g)
Y = torch.randint(0, 3, (16,), generator=g)

xs = st.shard(X, mesh, ("fsdp", None))
report["matmul_sum"] = (xs @ W.to(st.device())).sum().item()
report["doubled"] = (xs * 2).cpu().tolist()  # a sharded result read back: every process gets it all
report["uneven_plus_one"] = (st.shard(X[:13], mesh, ("fsdp", None)) + 1).cpu().tolist()
report["local_shards"] = [(s.device, s.indices[0].start, s.indices[0].stop) for s in xs.local_shards]

# issue 17: from_local / to_local with this process's block (its 4 devices hold rows 4*pid..4*pid+3)
local = torch.arange(12.0).reshape(4, 3) + 100 * pid
from_rows = st.from_local(local, mesh, [st.Shard(0)])
report["from_local"] = [list(from_rows.shape), from_rows.full_tensor().tolist(), from_rows.to_local().tolist()]
summed = st.from_local(local, mesh, [st.Partial()])  # each process's block is a summand
report["partial_sum"] = [summed.to_local().tolist(), summed.redistribute(mesh, [st.Replicate()]).full_tensor().tolist()]
report["partial_scatter"] = summed.redistribute(mesh, [st.Shard(0)]).to_local().tolist()

# MpDeviceLoader with minibatch: each process feeds its half of the global batch of 16
spec = st.ShardingSpec(mesh, ("fsdp", None), minibatch=True)
(batch,) = list(st.MpDeviceLoader([X[8 * pid : 8 * (pid + 1)]], st.device(), input_sharding=spec))
report["minibatch_shape"] = list(batch.shape)
report["minibatch"] = batch.cpu().tolist()
# issue 15: each process reads its own shard of a dataset through a DistributedSampler (rank and
# replicas given, so no process group is needed); with minibatch=True the step sees the global batch
dataset = torch.utils.data.TensorDataset(torch.arange(32.0 * 3).reshape(32, 3))
sampler = torch.utils.data.DistributedSampler(
    dataset, num_replicas=rt.process_count(), rank=rt.process_index(), shuffle=False
)
torch_loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
report["sampler_indices"] = list(sampler)
report["sampler_batches"], report["sampler_row_sums"] = [], []
for (rows,) in st.MpDeviceLoader(torch_loader, st.device(), input_sharding=spec):
    report["sampler_batches"].append(rows.cpu().tolist())
    report["sampler_row_sums"].append(rows.sum(0).cpu().tolist())  # a sharded reduction over the global batch

# FSDPv2 training, 3 SGD steps
torch.manual_seed(0)
model = FSDPv2(torch.nn.Linear(6, 3), mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
st.clear_counters()
for _ in range(3):
    loss = F.cross_entropy(model(xs), st.shard(Y, mesh, ("fsdp",)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    st.step()
    losses.append(loss.item())
report["losses"] = losses
report["compiles"] = st.counter_value("UncachedCompile")


@st.compile
def compiled_step(x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


st.clear_counters()
report["compiled_losses"] = [compiled_step(xs, st.shard(Y, mesh, ("fsdp",))).item() for _ in range(4)]
report["replays"] = st.counter_value("CompileReplay")

# torch.distributed.checkpoint over a gloo process group: each process writes the shards it owns
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=pid, world_size=2)
mesh42 = st.Mesh(range(8), (4, 2))
Z = torch.arange(70.0).reshape(7, 10)
dcp.save({"z": st.shard(Z, mesh42, (0, 1)), "bias": st.shard(Z[0, :7], mesh42, (0,))}, checkpoint_id=checkpoint_dir)
dist.barrier()
metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
report["dcp_written"] = sorted(
    [index.fqn, list(index.offset)]
    for index, info in metadata.storage_data.items()
    if info.relative_path.startswith(f"__{pid}_")
)
target = {"z": st.shard(torch.zeros(7, 10), st.Mesh(range(8), (2, 4)), (1, 0)), "bias": torch.zeros(7)}
dcp.load(target, checkpoint_id=checkpoint_dir)
report["dcp_loaded"] = [target["z"].cpu().tolist(), target["bias"].tolist(), target["z"].sharding_spec]
# all or nothing, each process reading only the shards of its own devices into host buffers
staged = {"z": st.shard(torch.zeros(7, 10), st.Mesh(range(8), (8,)), (None, 0))}
dcp.load(staged, checkpoint_id=checkpoint_dir, planner=st.checkpoint.StagedLoadPlanner())
report["dcp_staged"] = [staged["z"].cpu().tolist(), staged["z"].sharding_spec]
# CheckpointManager over the same group: rank 0 renames and prunes, every process writes its shards
manager = st.checkpoint.CheckpointManager(f"{checkpoint_dir}/manager", save_interval=1, max_to_keep=1)
manager.save(1, {"z": st.shard(Z, mesh42, (0, 1))})
manager.save_async(2, {"z": st.shard(Z * 2, mesh42, (0, 1))})
manager.join()
resumed = {"z": st.shard(torch.zeros(7, 10), st.Mesh(range(8), (8,)), (0, None))}
manager.load(max(manager.all_steps()), resumed)
fresh = st.checkpoint.CheckpointManager(f"{checkpoint_dir}/manager", save_interval=1, max_to_keep=1)
report["manager"] = [manager.all_steps(), fresh.all_steps(), resumed["z"].cpu().tolist()]
report["manager"].append(sorted(os.listdir(f"{checkpoint_dir}/manager")))  # no temporary directory left
# issue 14: an atomic save by both processes (the test loads it in one process), and a checkpoint the
# test wrote from one process loaded into another mesh and spec, each process reading only its shards
W = torch.arange(30.0).reshape(5, 6)
atomic_state = {"z": st.shard(Z, mesh42, (0, 1)), "w": st.shard(W, mesh42, (1, 0)), "step": 7}
st.checkpoint.save(atomic_state, f"{checkpoint_dir}/atomic")  # (the default process group)
report["atomic_listing"] = sorted(os.listdir(checkpoint_dir))
# dcp.async_save: the shards copied to the host here, written in DCP's thread over a group of its own
async_group = dist.new_group([0, 1], backend="gloo")
async_z = st.shard(Z, mesh42, (0, 1))
stager = st.checkpoint.HostStager()
future = dcp.async_save(
    {"z": async_z}, checkpoint_id=f"{checkpoint_dir}/async", process_group=async_group, async_stager=stager
)
with torch.no_grad():
    async_z.mul_(0)  # (training goes on: the checkpoint has the values staged)
future.result()
from_one = {"a": st.shard(torch.zeros(9, 6), st.Mesh(range(8), (2, 4)), (0, 1)), "b": torch.zeros(3)}
report["from_one_chunks"] = sorted(
    [list(c.offsets), list(c.sizes)] for c in from_one["a"].__create_chunk_list__()
)  # (what a load of "a" reads in this process)
st.checkpoint.load(from_one, f"{checkpoint_dir}/from_one", process_group=dist.new_group([0, 1]))
report["from_one"] = [from_one["a"].cpu().tolist(), from_one["b"].tolist(), from_one["a"].sharding_spec]
dist.destroy_process_group()

# st.save (xr.save): every process calls it (the readback is collective); with master_only=True only
# process 0 writes. Each process names its own file, so the test sees who wrote.
import os  # noqa: E402

saved = {"z": st.shard(Z, mesh42, (0, 1)), "step": 3}
report["st_save_paths"] = [os.path.join(checkpoint_dir, f"{kind}_{pid}.pt") for kind in ("master_only", "every")]
st.save(saved, report["st_save_paths"][0])
st.save(saved, report["st_save_paths"][1], master_only=False)
print("REPORT", json.dumps(report))
