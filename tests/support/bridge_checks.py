"""Checks of parallel.cpu_bridge, run in a fresh process (the bridge patches torch
globally, so it must not be installed into the pytest process)."""

import torch
import torch.distributed as dist

from parallel import cpu_bridge
from parallel.launch import free_port

assert not cpu_bridge.is_installed()
cpu_bridge.install()
cpu_bridge.install()  # idempotent
assert cpu_bridge.is_installed()

# 1. current_device() is a usable device; literal "cuda" lands on the CPU
assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(3, device="cuda").device.type == "cpu"
assert torch.tensor([1, 2], device="cuda:0", pin_memory=True).device.type == "cpu"
x = torch.arange(4.0)
assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(torch.float64).dtype == torch.float64
assert (
    x.to(device="cuda:0", dtype=torch.float16).dtype == torch.float16
    and x.new_zeros(2, device="cuda").device.type == "cpu"
)
# device contexts still see the (wrapped) factories: transformers tests torch.tensor([]).device for one
with torch.device("meta"):
    assert torch.tensor([]).device.type == "meta" and torch.zeros(2).device.type == "meta"

# 2. streams and events are no-ops that keep their interfaces
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    s.wait_stream(torch.cuda.current_stream())
ev = torch.cuda.Event(enable_timing=True)
ev.record()
torch.cuda.synchronize()
x.record_stream(torch.cuda.current_stream())

# 3. type names the optimizer checks
assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64

# 4. the model-parallel RNG tracker forks the CPU generator and restores it
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils

import os

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state

parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(7)
torch.manual_seed(0)
before = torch.get_rng_state()
with get_cuda_rng_tracker().fork():
    a = torch.rand(3)
with get_cuda_rng_tracker().fork():
    b = torch.rand(3)
assert not torch.equal(a, b), "the tracker's state must advance between forks"
assert torch.equal(torch.get_rng_state(), before), "the default generator must be restored"
model_parallel_cuda_manual_seed(7)
with get_cuda_rng_tracker().fork():
    assert torch.equal(torch.rand(3), a), "reseeding the tracker must reproduce its stream"

# 5. host split sizes; the Transformer-Engine symbol is not the bridge's (parallel.megatron_compat)
assert not hasattr(moe_utils, "te_general_gemm")
from parallel import megatron_compat

megatron_compat.install()
assert moe_utils.te_general_gemm is None
splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
assert not torch.is_tensor(splits) and list(splits) == [1, 2]

# 6. uneven all_gather / reduce_scatter (world of one: shapes still validated)
out = [torch.empty(2, 3)]
dist.all_gather(out, torch.ones(2, 3))
assert torch.equal(out[0], torch.ones(2, 3))

# 7. a strided tensor in a collective is refused, as NCCL refuses it (gloo would fill it as if dense)
halves = torch.zeros(4, 6).chunk(2, dim=1)
for call in (lambda: dist.broadcast(halves[0], src=0), lambda: dist.all_reduce(tensor=halves[1])):
    try:
        call()
    except ValueError as e:
        assert "strided tensor" in str(e) and "NCCL refuses" in str(e), e
    else:
        raise AssertionError("a strided tensor must be refused")
dense = halves[0].contiguous()
dist.broadcast(dense, src=0)  # dense ones pass

# 8. with a CPU-only torch, megatron's helpers are not torch.compile'd (parallel.fusers): its
# jit_fuser is its own no-op and torch's inductor was not imported for them
import sys  # noqa: E402

import megatron.core.jit  # noqa: E402
from megatron.core.fusions import fused_bias_geglu  # noqa: E402, F401

if torch.version.cuda is None and torch.version.hip is None:
    assert megatron.core.jit.jit_fuser is megatron.core.jit.noop_decorator
    assert "torch._inductor.compile_fx" not in sys.modules
# 9. an all_reduce over a one-rank group returns at once with the tensor as it was, also
# async and inside a coalescing manager (the multi-process tests cover larger groups)
from torch.distributed.distributed_c10d import _coalescing_manager  # noqa: E402

one = dist.new_group([0])
values = torch.tensor([1.5, -2.0, 3.25])
for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
    t = values.clone()
    assert dist.all_reduce(t, op=op, group=one) is None and torch.equal(t, values), op
    work = dist.all_reduce(t, op=op, async_op=True)
    assert work.wait() and torch.equal(t, values), op
with _coalescing_manager(group=one, async_ops=True) as cm:  # megatron's gradient-buffer sync
    dist.all_reduce(t, group=one, async_op=True)
cm.wait()
assert torch.equal(t, values)
print("bridge checks passed")
