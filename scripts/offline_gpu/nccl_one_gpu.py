"""Do two NCCL ranks run on one GPU? (ance-train's trainer maps LOCAL_RANK to its own
device, as torchrun expects; NCCL is documented to refuse two ranks on one device.) Prints
each rank's outcome of one all_reduce; exit 0 either way, the answer is in the output."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        value = torch.ones(4, device="cuda") * (rank + 1)
        dist.all_reduce(value)
        torch.cuda.synchronize()
        print(f"rank {rank}: all_reduce on one GPU gave {value.tolist()} (expected 3.0s), "
              f"NCCL {torch.cuda.nccl.version()}", flush=True)
        dist.destroy_process_group()
    except Exception as error:  # the outcome is the answer
        print(f"rank {rank}: {type(error).__name__}: {str(error)[:400]}", flush=True)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank_main, args=(free,), nprocs=2, join=True)
