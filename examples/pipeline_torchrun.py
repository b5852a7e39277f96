"""Train a Llama model split across processes (or machines) by an automap plan.

Every rank builds the same model (same seed; in real use, load one checkpoint), automap plans
it for one hypothetical device per rank, and torch.distributed.pipelining runs this rank's
stage under a 1F1B (or GPipe) schedule. gloo on CPU, NCCL on GPUs.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py                 # one machine
    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py --check         # compare with one process
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/pipeline_torchrun.py --layers 16 --hidden 512                # two machines, 8 stages

Nothing is downloaded: the model is built from a config with random weights.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from automap.distributed import RankPipeline, build_stage, make_schedule, plan_for_ranks

log = logging.getLogger("pipeline_torchrun")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (>= number of ranks)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument(
        "--check",
        action="store_true",
        help="first compare outputs and gradients with the whole model in one process",
    )
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=max(128, args.seq),
    )
    torch.manual_seed(0)  # every rank must hold the same weights
    return LlamaForCausalLM(config)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(args: argparse.Namespace, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)  # the same data on every rank
    tokens = torch.randint(0, 512, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def step(pipe: RankPipeline, schedule, ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    if pipe.is_first:
        schedule.step(ids)
    elif pipe.is_last:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()
    return losses


def check(model: nn.Module, pipe: RankPipeline, args: argparse.Namespace, device: torch.device) -> None:
    """Compare this rank's gradients after one pipelined step with the whole model's."""
    ids, labels = batch(args, 0, device)
    ref = copy.deepcopy(model).to(device)
    ref_loss = loss_fn(ref(ids, use_cache=False).logits, labels)
    ref_loss.backward()
    grads = dict(ref.named_parameters())
    losses = step(pipe, make_schedule(pipe.stage, args.schedule, args.chunks, loss_fn), ids, labels)
    worst = max(
        (p.grad - grads[n].grad).abs().max().item() / (grads[n].grad.abs().max().item() + 1e-12)
        for n, p in pipe.module.named_parameters()
    )
    ok = worst < 1e-3
    if pipe.is_last:
        ok &= abs(torch.stack(losses).mean().item() - ref_loss.item()) < 1e-4 * max(1.0, ref_loss.item())
    verdict = torch.tensor([0 if ok else 1])
    dist.all_reduce(verdict)  # every rank exits with the same verdict
    if verdict.item():
        raise SystemExit(
            f"rank {pipe.rank}: pipelined step differs from one process (worst relative {worst:.2e})"
        )
    log.info(
        "rank %d: pipelined gradients match one process (worst relative difference %.1e)", pipe.rank, worst
    )
    if pipe.rank == 0:
        log.info("check passed: the pipelined step matches one process")
    pipe.module.zero_grad()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK', '0')}] %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        model = build_model(args)
        plan = plan_for_ranks(model, world)
        if rank == 0:
            log.info("automap plan for %d ranks:\n%s", world, plan.report())
        model.config.use_cache = False  # no KV cache in a training graph
        ids, _ = batch(args, 0, device)
        pipe = build_stage(
            model,
            plan,
            (ids.cpu(),),
            rank=rank,
            world_size=world,
            device=device,
            chunks=args.chunks,
            schedule=args.schedule,
            loss_fn=loss_fn,
        )
        if args.check:
            check(model, pipe, args, device)
        optimizer = torch.optim.AdamW(pipe.module.parameters(), lr=1e-3)
        for i in range(args.steps):
            ids, labels = batch(args, i, device)
            optimizer.zero_grad()
            losses = step(pipe, pipe.schedule, ids, labels)
            optimizer.step()
            if pipe.is_last:
                log.info("step %d: loss %.4f", i, torch.stack(losses).mean().item())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
