import torch, torch.distributed as dist, time, sys
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._subclasses.fake_tensor import FakeTensorMode, FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
import torch.distributed._tools.fake_collectives
import shardwise
from shardwise.models import GPT, GPTConfig, TransformerLayer
W=int(sys.argv[1]) if len(sys.argv)>1 else 64
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
def ago(out, obj, group=None):
    out[:] = [obj]*len(out)
dist.all_gather_object = ago
class RealStaysReal(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
mesh = shardwise.build_dp_mesh()
cfg = GPTConfig(vocab_size=32000, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_hidden=5632, max_seq_len=4096)
t=time.time()
with FakeTensorMode() as fm, RealStaysReal():
    model = GPT(cfg)
    print("built", time.time()-t)
    model = shardwise.fully_shard(model, mesh, unit_modules=[TransformerLayer, model.embed, model.output],
        mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    print("wrapped", time.time()-t)
    groups = model.sharded_state.groups
    print({k: sum(g.resident_bytes()[k] for g in groups) for k in groups[0].resident_bytes()})
    from torch.distributed._tools.mem_tracker import MemTracker
    mt = MemTracker()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mt.track_external(model, opt)
    tokens = torch.randint(0, 32000, (1, 4097))
    mt.__enter__()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    print("fwd", time.time()-t)
    loss.backward()
    print("bwd", time.time()-t)
    print({k: sum(g.resident_bytes()[k] for g in groups) for k in groups[0].resident_bytes()})
    opt.step()
    opt.zero_grad()
    loss = model(tokens[:, :-1], tokens[:, 1:]); loss.backward(); opt.step()
    mt.__exit__(None,None,None)
    snap = mt.get_tracker_snapshot('peak')
    print({str(k): {str(a): b/2**20 for a,b in v.items()} for k,v in snap.items()})
    print("step", time.time()-t)
