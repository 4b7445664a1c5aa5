"""A tensor-parallel engine: one leader schedules and samples, the other ranks of its group
run the same forwards on their shards (models/tensor_parallel.py has the sharding).

Every rank of a group of N builds the same `Engine`; rank 0 of the group (the leader) is the
engine a caller sees: requests, the scheduler, the proposer, sampling and the output processor
run there alone. Each model operation of a step (a forward over the packed rows, the LM head
over hidden states, a verified tree's K/V moved into place) is first broadcast to the group as
a small message of plain Python data (block tables, positions, token ids) and then run by every
rank at once, so the all-reduces inside the forward pair up. The followers loop over these
messages (`Engine.follow`) until the leader lets them go.

Why the leader schedules and broadcasts, rather than every rank scheduling deterministically:
requests reach one process (the HTTP server runs on rank 0), and the engine's speculative
policy decides by measured step times, which differ between ranks; one scheduler cannot
diverge from itself. Sampling needs the logits on the leader only (they are all-gathered,
every rank's vocabulary slice): sampled once, with the engine's seeds and keyed uniforms, the
tokens are the same whatever N is, and the followers never need them (the next step's message
carries its token ids).

The messages go over a gloo group (`control`), the tensors over the group the layers reduce
on (NCCL on GPUs): a server idle for hours waits on gloo with a long timeout, not on NCCL.
"""

from __future__ import annotations

import shlex
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reclaim.engine.speculative import MODEL_METHODS
from reclaim.models.tensor_parallel import TensorParallel, check_tensor_parallel, shard_llama

# How long a follower waits for the leader's next message: a server may sit idle for long.
IDLE_TIMEOUT = timedelta(days=365)


def torchrun_line(size: int, argv: list[str]) -> str:
    """The command that runs `argv` (a `reclaim ...` command line) on `size` local ranks."""
    return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={size}", "--no-python", "reclaim", *argv])


def check_launch(size: int, cfg: Any, argv: list[str]) -> None:
    """Refuse a TP size the model cannot be split by, or a TP size above 1 outside torchrun (the
    error shows the torchrun line to use); reads only the config, so it runs before any weights
    load. `argv`: the command's arguments after `reclaim`."""
    import os

    check_tensor_parallel(cfg, size)
    if size == 1:
        return
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise ValueError(f"--tensor-parallel-size {size} runs one process per rank under torchrun; run: "
                         f"{torchrun_line(size, argv)}")
    if int(world) != size:
        raise ValueError(f"--tensor-parallel-size {size} under torchrun with WORLD_SIZE={world}; they must be "
                         f"equal: {torchrun_line(size, argv)}")


def start_group(size: int, device: torch.device) -> tuple[Any, Any]:
    """Join torchrun's group for a TP server (gloo on a CPU, NCCL on CUDA) and make the gloo
    group the leader's messages use; returns (group, control)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but the process group has {dist.get_world_size()} ranks")
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return dist.group.WORLD, control


class TPChannel:
    """The leader's step messages to the other ranks of its TP group."""

    def __init__(self, tp: TensorParallel, device: torch.device, control: Any = None) -> None:
        self.tp, self.device = tp, device
        self.control = control if control is not None else tp.group
        self.src = dist.get_global_rank(tp.group, 0)  # the leader's rank in the world
        self.is_leader = tp.rank == 0

    def send(self, op: str, *args: Any) -> None:
        """The leader: announce an operation every rank runs now (plain Python data)."""
        dist.broadcast_object_list([(op, args)], src=self.src, group=self.control)

    def recv(self) -> tuple[str, tuple]:
        """A follower: the leader's next operation (waits for it)."""
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=self.src, group=self.control)
        return got[0]

    def share(self, x: torch.Tensor | None, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None
              ) -> torch.Tensor:
        """The leader's tensor `x` on every rank (followers pass its shape and dtype)."""
        if x is None:
            x = torch.empty(shape, dtype=dtype, device=self.device)
        x = x.contiguous()
        dist.broadcast(x, src=self.src, group=self.tp.group)
        return x

    def agree_min(self, n: int) -> int:
        """The smallest of every rank's `n` (the KV blocks all ranks can hold)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def tensor_parallel(model: torch.nn.Module, size: int, device: torch.device, group: Any = None,
                    control: Any = None) -> TPChannel | None:
    """The channel of a TP engine over `group` (default: the whole world, which must have `size`
    ranks), the model sharded over it unless it is already; None for one rank without a group."""
    if group is None and size == 1:
        return None
    if group is None:
        if not dist.is_initialized():
            raise ValueError(f"tensor_parallel_size={size} needs a process group of {size} ranks: run under "
                             f"torchrun (e.g. {torchrun_line(size, ['serve', '--tensor-parallel-size', str(size)])})"
                             " or pass tp_group")
        group = dist.group.WORLD
    n = dist.get_world_size(group)
    if size not in (1, n):
        raise ValueError(f"tensor_parallel_size={size} but the TP group has {n} ranks; they must be equal")
    tp = getattr(model, "tensor_parallel", None) or shard_llama(model, group)
    if tp.group is not group and dist.get_process_group_ranks(tp.group) != dist.get_process_group_ranks(group):
        raise ValueError("the model is sharded over another group than the engine's tp_group")
    return TPChannel(tp, device, control)


def refuse_on_tensor_parallel(recorder: Any) -> None:
    """What a TP engine cannot run, refused by name: recorded prefills (online learning)."""
    if recorder is not None:
        raise ValueError("a recorder (online learning, serve --learn) needs the whole model on one rank; "
                         "allowed with tensor_parallel_size > 1: none")


class LeaderTarget(torch.nn.Module):
    """What an EAGLE drafter takes from its target, whole, on the TP leader: the token embedding
    and the LM head (the target's own are cut by vocabulary over the group, and calling them is
    a collective the followers would have to join). The drafter then runs on the leader alone,
    from the hidden states every rank holds whole after each layer's all-reduce. Costs the
    leader one unsharded embedding and head (one tensor when tied) beside its shards."""

    NAMES = ("model.embed_tokens.weight", "lm_head.weight")

    def __init__(self, config: Any, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight if head is None else torch.nn.Parameter(
            head, requires_grad=False)

    @classmethod
    def gather(cls, model: torch.nn.Module, tp: TensorParallel) -> "LeaderTarget | None":
        """The whole embedding and head gathered from every rank's rows (a collective: every
        rank calls it); the leader's, None elsewhere."""
        def whole(w: torch.Tensor) -> torch.Tensor:
            return tp.gather_vocab(w.detach().t().contiguous()).t().contiguous()  # rows in rank order

        embed = whole(model.model.embed_tokens.weight)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        head = None if tied else whole(model.lm_head.weight)
        return cls(model.config, embed, head) if tp.rank == 0 else None

    def update(self, name: str, full: torch.Tensor) -> None:
        """New whole weights (update_weights' unsharded tensors) for the tensors it holds."""
        with torch.no_grad():  # in place on the parameters, so their version counters move (linear.packed)
            if name == self.NAMES[0]:
                self.model.embed_tokens.weight.copy_(full)
            elif name == self.NAMES[1] and self.lm_head.weight is not self.model.embed_tokens.weight:
                self.lm_head.weight.copy_(full)


def retarget(proposer: Any, target: LeaderTarget) -> None:
    """Point an EAGLE proposer (alone, or inside the hybrid) at the leader's whole embedding and head."""
    for p in (proposer, getattr(proposer, "model", None)):
        if p is not None and hasattr(p, "drafter") and hasattr(p, "head"):
            p.embed, p.head, p.target = target.model.embed_tokens, target.lm_head, target
            p._head_rows = None  # the draft head's rows are copied again from the whole head


def draft_target(model: torch.nn.Module, channel: TPChannel | None, speculative: Any, proposer: Any
                 ) -> tuple[Any, bool]:
    """The model an EAGLE drafter reads the embedding and head of, and whether one can draft: the
    model itself on one rank; on a TP engine whose config or proposer drafts with EAGLE, the
    leader's LeaderTarget (the proposer pointed at it; followers build but never run their
    drafter). A TP engine built without one gathers nothing and takes no EAGLE drafter later."""
    if channel is None:
        return model, True
    model_drafter = getattr(speculative, "method", None) in MODEL_METHODS or any(
        hasattr(p, "drafter") for p in (proposer, getattr(proposer, "model", None)) if p is not None)
    if not model_drafter:
        return model, False
    target = LeaderTarget.gather(model, channel.tp)
    if target is None:  # a follower
        return model, True
    if proposer is not None:
        retarget(proposer, target)
    return target, True
