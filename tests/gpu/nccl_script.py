"""An unmodified-style NCCL script: each rank takes its own GPU from DDPD_CUDA_DEVICES (else LOCAL_RANK),
all-reduces a CUDA tensor and prints ``NCCL done rank=R device=D sum=S uuid=U``."""

import os

import torch
import torch.distributed as dist


def main():
    local = int(os.environ["LOCAL_RANK"])
    device = int(os.environ.get("DDPD_CUDA_DEVICES", str(local)).split(",")[0])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    value = torch.tensor([dist.get_rank() + 1.0], device="cuda")
    dist.all_reduce(value)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    print(f"NCCL done rank={dist.get_rank()} device={device} sum={value.item():g} uuid={uuid}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
