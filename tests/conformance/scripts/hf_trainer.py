"""HF ``Trainer`` on a tiny GPT-2 built from a config (random weights, nothing downloaded) and
synthetic tokens, a few steps under DDP on CPU (gloo), then ``save_pretrained`` (safetensors).

    torchrun --nproc-per-node 2 hf_trainer.py   # writes out/model/{config.json,model.safetensors,...}
"""

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub: the model is built here
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="scratch/trainer", per_device_train_batch_size=4, max_steps=6,
                         learning_rate=1e-3, report_to="none", save_strategy="no", disable_tqdm=True,
                         use_cpu=True, ddp_backend="gloo", seed=0, logging_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
result = trainer.train()
if trainer.is_world_process_zero():
    model.save_pretrained("out/model")
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"RESULT rank={trainer.args.process_index} loss={result.training_loss:.6f} checksum={checksum:.6f} "
      f"steps={result.global_step}", flush=True)
# the DDP wrapper freed and the group destroyed while the interpreter still runs (see test_exit_path.py)
del trainer
gc.collect()
dist.destroy_process_group()
