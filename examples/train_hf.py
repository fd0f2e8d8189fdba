"""A Hugging Face `Trainer` script, migrated live: a tiny GPT-2 made from its config (no download),
trained on synthetic tokens by the Trainer's own loop with a cosine schedule and warm-up, gradient
accumulation, dropout, periodic checkpoints and a final `save_model`. The lines marked `torchpass`
are all it takes.

Run it with `torchpass run --nproc 2 --spares 1 examples/train_hf.py -- --steps 40 --out /tmp/hf`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from job_agent import RankAgent  # torchpass
from job_agent.frameworks.hf import LiveTrainer  # torchpass


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences: each is its own labels (causal language modelling)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(callbacks: Sequence[TrainerCallback] = ()) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True, help="the Trainer's output directory")
    p.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (mixed precision)")
    p.add_argument("--final", default=None, help="save_model here once training is done")
    args = p.parse_args()

    agent = RankAgent()  # torchpass: before TrainingArguments, which reads the job's group
    torch.manual_seed(1234)  # the same initial weights on every rank
    config = GPT2Config(
        n_layer=args.layers, n_head=2, n_embd=args.width, vocab_size=64, n_positions=32
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=4,
        weight_decay=0.01,
        logging_steps=5,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        report_to=[],
        seed=1234,
        disable_tqdm=True,
    )
    trainer = LiveTrainer(  # torchpass: the Trainer, with the agent's step boundary in its loop
        model=model,
        args=training,
        train_dataset=Tokens(512, 16, 64),
        callbacks=list(callbacks),
        agent=agent,
    )
    trainer.train()
    if args.final:
        trainer.save_model(args.final)


if __name__ == "__main__":
    main()
