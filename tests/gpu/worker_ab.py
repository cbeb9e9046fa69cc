"""One rank of the A/B DDP step (issue 61): stock and hpct DDP alternating in one process.

Each rank holds both stacks at once: the default group is stock's (ProcessGroupNCCL on a GPU, Gloo
with AB_DEVICE=cpu: the CPU tier's check of this worker), the hpct group is ``new_group(backend=
"hpct")`` (its CUDA tensors go to hpct's NCCL engine).  Two copies of one model, one DDP on each
group, train on the same batches.  Each round runs AB_STEPS steps of one stack, then of the other
(the order alternates: ABBA...), each step ended by a device sync; the round's ratio is the median
hpct step over the median stock step.  Drift of the machine (MPS neighbours, clocks) falls on both
stacks of a round alike, so the rounds' ratios are what the 95 % interval is made of (targets.py).

The model is the DDP-step table's (worker_speed.py): an embedding, AB_LAYERS encoder layers of width
AB_WIDTH, a head; 30.2 M parameters at the defaults.  Both copies must end bit-identical (the same
library and pins reduce in one order): the digest line says so.
"""

import copy
import datetime
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

CPU = os.environ.get("AB_DEVICE") == "cpu"
if CPU:
    rank, n, dev = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), torch.device("cpu")
else:
    import proof_settings as ps  # noqa: E402
    rank, n, dev, _ = ps.start_rank()
ROUNDS, STEPS, WARM = (int(os.environ.get(k, d)) for k, d in (("AB_ROUNDS", "16"), ("AB_STEPS", "6"),
                                                              ("AB_WARM", "5")))
VOCAB, WIDTH, LAYERS, SEQ, BATCH = (int(os.environ.get(k, d)) for k, d in (
    ("AB_VOCAB", "8192"), ("AB_WIDTH", "640"), ("AB_LAYERS", "4"), ("AB_SEQ", "128"), ("AB_BATCH", "8")))


def sync():
    if not CPU:
        torch.cuda.synchronize()


timeout = datetime.timedelta(seconds=120)
if CPU:
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timeout)
else:
    dist.init_process_group("nccl", rank=rank, world_size=n, timeout=timeout, device_id=dev)
    torch.backends.cuda.enable_flash_sdp(False)       # both stacks train alike to the bit (worker_speed.py)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
import hpct.distributed  # noqa: E402,F401  (registers the backend)
hpct_group = dist.new_group(backend="hpct")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, max(1, WIDTH // 64), 4 * WIDTH, dropout=0.0,
                                                 batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)))


torch.manual_seed(0)
base = Net()
params = sum(p.numel() for p in base.parameters())
stacks = {}
for name, group in (("stock", None), ("hpct", hpct_group)):
    model = copy.deepcopy(base).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if CPU else [0], process_group=group)
    stacks[name] = (model, ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
g = torch.Generator(device="cpu").manual_seed(100 + rank)
data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(dev) for _ in range(8)]
count = {"stock": 0, "hpct": 0}


def step(name) -> float:
    _, ddp, opt = stacks[name]
    ids = data[count[name] % len(data)]
    count[name] += 1
    sync()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(ddp(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    sync()
    return (time.perf_counter() - t0) * 1e3


for _ in range(WARM):
    for name in stacks:
        step(name)
lines = []
for k in range(ROUNDS):
    order = ("stock", "hpct") if k % 2 == 0 else ("hpct", "stock")
    med = {name: statistics.median(step(name) for _ in range(STEPS)) for name in order}
    lines.append(f"ABSTEP n={n} round={k} first={order[0]} stock_ms={med['stock']:.3f} hpct_ms={med['hpct']:.3f} "
                 f"ratio={med['hpct'] / med['stock']:.5f}")
digests = {name: hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
           for name, (model, _, _) in stacks.items()}
if rank == 0:
    print("\n".join(lines), flush=True)
    print(f"ABSTEP n={n} params={params} rounds={ROUNDS} steps={STEPS} device={dev.type} "
          f"digests_equal={digests['stock'] == digests['hpct']} digest={digests['hpct'][:16]}", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
