"""GNN-style feature gathering from one node-feature table shared by every process: each step
gathers the features of random nodes (as neighbour sampling does). Host memory; no GPU needed.

    torchrun --standalone --nproc_per_node=2 examples/shared/gnn_feature_gather.py --nodes 1000000
"""

import argparse
import time

import torch

import tensortier.shared as shared

parser = argparse.ArgumentParser()
parser.add_argument("--nodes", type=int, default=200_000)
parser.add_argument("--features", type=int, default=128)
parser.add_argument("--batch", type=int, default=1024)
parser.add_argument("--fanout", type=int, default=10)
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

group = shared.Group()  # torchrun's environment
table = group.create_tensor((args.nodes, args.features), torch.float32)
rows, (begin, end) = table.local()
# Each rank fills its own rows (here: the node id in every column).
rows.copy_(torch.arange(begin, end, dtype=torch.float32).unsqueeze(1).expand(-1, args.features))
group.barrier()

gen = torch.Generator().manual_seed(group.rank)
start = time.perf_counter()
gathered = 0
for step in range(args.steps):
    seeds = torch.randint(0, args.nodes, (args.batch,), generator=gen)
    neighbours = torch.randint(0, args.nodes, (args.batch * args.fanout,), generator=gen)
    nodes = torch.cat([seeds, neighbours])
    features = table.gather(nodes)
    if not torch.equal(features[:, 0], nodes.to(torch.float32)):
        raise SystemExit(f"rank {group.rank}: step {step} gathered the wrong rows")
    gathered += nodes.numel()
elapsed = time.perf_counter() - start
print(f"rank {group.rank}: {gathered / elapsed:,.0f} rows/s, {table.stats['local_bytes'] >> 20} MiB owned")
group.barrier()
group.close()
