"""distributed.py: what one tensor-parallel rank knows of its group, and the collectives it calls.

With `tensor_parallel_size` N, N worker processes each hold 1/N of every large weight
(models/llama.py `shard_for_tp`; a mixture of experts' experts: a slice of each, or with
`enable_expert_parallel` 1/N of them whole, models/mixture_of_experts.py) and run the same step
on it. Three collectives put the pieces back together, all over torch.distributed (gloo on CPU,
NCCL on CUDA):

    all_reduce      after each row-parallel product (o_proj, down_proj, the experts' w2) and the
                    vocab-parallel embedding: every rank computed a partial sum of the same
                    [tokens, hidden]
    gather_logits   the LM head: rank r computed logits for its vocab slice; rank 0 stitches
                    [n, vocab] together to sample, the other ranks get None
    min_int         the KV pool: each rank sizes its own, all use the smallest

Data parallel + expert parallel (`--data-parallel-size N --enable-expert-parallel`, TP 1, one
host): the N engine cores are the group (`init_data_parallel_experts`) and DP rank r holds experts
[r * E / N, (r + 1) * E / N) whole. Each MoE layer then exchanges tokens, vLLM's simplest form
(its AgRsAll2AllManager; `ExpertExchange`): once a forward `begin` all-gathers each rank's row
count, then in each layer `dispatch` all-gathers every rank's hidden states and router logits,
each rank runs its own experts on all of them, and `combine` sums the partial outputs back onto
the rank that owns each token (reduce-scatter). Every rank sees every token: per MoE layer a
rank receives ~(N - 1) x the largest rank's tokens x (hidden + num_experts) values, and the
combine moves about as many hidden values again: the hidden states cross the group twice. Each
is a collective, so all N cores run the same number of forwards (`any_rank`: the lockstep of
engine_core.py's loop).

A `TensorParallel` of size 1 (SINGLE) is what the single-process engine passes: the model checks
`tp.size > 1` before any collective, so TP=1 runs no collective and no extra copy.

Run the tests (TP=2 over gloo == TP=1 == HF, token for token; DP+EP == one process, served):
    pytest -q tests/test_tensor_parallel.py tests/test_expert_parallel.py
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # vLLM's enable_expert_parallel: a mixture of experts' experts are shared out whole among the
    # ranks (each holds num_experts / size of them), not each sliced across all of them.
    enable_expert_parallel: bool = False
    # DP+EP: the experts are shared out among the data-parallel ranks instead (TP is 1 there),
    # which exchange their tokens around them
    expert_exchange: Optional[ExpertExchange] = field(default=None, compare=False)

    def shard(self, n: int) -> tuple[int, int]:
        """[start, end) of rank's share of n rows split `size` ways (the last may be short)."""
        per = -(-n // self.size)
        return min(self.rank * per, n), min((self.rank + 1) * per, n)

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x)
        return x

    def gather_logits(self, logits: Tensor, vocab_size: int) -> Optional[Tensor]:
        """Each rank's [n, vocab / size] slice -> [n, vocab] on rank 0 (None elsewhere)."""
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=0)
        # The last slice is padded when size does not divide the vocabulary: cut the padding.
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    def min_int(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


@dataclass
class ExpertExchange:
    """DP+EP: this engine core's place among the `size` data-parallel ranks that share the
    experts, and their exchange of tokens (the module docstring). `begin` gathers every rank's
    row count once a forward (the runner calls it, as vLLM's forward context carries
    num_tokens_across_dp); each MoE layer's `dispatch` and `combine` read it."""

    rank: int
    size: int
    counts: list[int] = field(default_factory=list)     # each rank's rows in this forward

    def begin(self, num_rows: int) -> None:
        counts = torch.empty(self.size, dtype=torch.int64)
        _all_gather(counts, torch.tensor([num_rows]))
        self.counts = counts.tolist()

    def any_rank(self, flag: bool) -> bool:
        """The lockstep: whether `flag` holds on any data-parallel rank (a MAX all-reduce)."""
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def dispatch(self, hidden: Tensor, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """Before the experts: every rank's (hidden, router_logits) rows, in rank order, on every
        rank. Each rank's rows are padded to the most any rank has (a collective moves equal
        shapes), and cut back after; hidden and logits travel as one tensor."""
        most, width = max(self.counts), hidden.shape[1]
        padded = hidden.new_zeros(most, width + router_logits.shape[1])
        padded[:len(hidden), :width], padded[:len(hidden), width:] = hidden, router_logits
        gathered = padded.new_empty(self.size * most, padded.shape[1])
        _all_gather(gathered, padded)
        everyone = gathered[_real_rows(self.counts)]
        return everyone[:, :width], everyone[:, width:]

    def combine(self, out: Tensor) -> Tensor:
        """After the experts: `out` holds this rank's experts' part of every rank's rows
        (dispatch's order); the parts are summed onto the rank each row came from (a
        reduce-scatter, over rows padded as in dispatch). Returns this rank's rows."""
        most = max(self.counts)
        padded = out.new_zeros(self.size * most, out.shape[1])
        padded[_real_rows(self.counts)] = out
        mine = out.new_empty(most, out.shape[1])
        _reduce_scatter(mine, padded)
        return mine[:self.counts[self.rank]]


SINGLE = TensorParallel()
# torch 2.13 renamed the single-tensor collectives (the old names warn); torch >= 2.5 has the old
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _real_rows(counts: list[int]) -> Tensor:
    """Where the real rows sit when each rank's `counts[r]` rows are padded to max(counts):

    >>> _real_rows([2, 0, 1]).tolist()
    [0, 1, 4]
    """
    most = max(counts)
    return torch.cat([torch.arange(n) + rank * most for rank, n in enumerate(counts)])


def free_port() -> int:
    """A TCP port on loopback nobody listens on now (for the scripts' and tests' servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_device_for_rank(rank: int, world_size: int, device_count: int,
                         local_rank: Optional[int] = None) -> int:
    """The GPU index of `rank` on its host: `local_rank` when a launcher spread the ranks over
    hosts (its LOCAL_RANK), else the rank itself, as nanoserve starts every rank on one host.
    ValueError when the host has fewer GPUs than the ranks it must hold."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size {world_size}")
    index = rank if local_rank is None else local_rank
    needed = world_size if local_rank is None else local_rank + 1
    if needed > device_count:
        raise ValueError(f"tensor_parallel_size {world_size} needs {needed} GPUs on this host, "
                         f"torch sees {device_count} (CUDA_VISIBLE_DEVICES?)")
    return index


def _launcher_local_rank(rank: int) -> Optional[int]:
    """LOCAL_RANK, when a launcher (torchrun) set it for this very rank. The workers nanoserve
    spawns inherit their parent's environment, so a LOCAL_RANK beside another RANK is not theirs."""
    if "LOCAL_RANK" in os.environ and os.environ.get("RANK") == str(rank):
        return int(os.environ["LOCAL_RANK"])
    return None


def place_data_parallel_rank(local_index: int, num_local: int, tensor_parallel_size: int) -> None:
    """Give the `local_index`-th of this host's `num_local` engine cores its share of the host,
    before CUDA starts (its TP workers inherit it): on CUDA the GPUs local_index * TP ..
    local_index * TP + TP - 1 of those visible (CUDA_VISIBLE_DEVICES, as vLLM does), on a CPU
    1/num_local of the cores (its TP workers split that share again: init_tensor_parallel)."""
    tp = tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(num_local * tp)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[local_index * tp:(local_index + 1) * tp])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local))


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str,
                         num_engine_cores: int = 1) -> torch.device:
    """Join the group as `rank` and return this rank's device: on CUDA one GPU per rank and
    NCCL; on CPU gloo, with the cores shared out among every rank of every engine core of this
    host (N ranks each using every core would fight over them: on 2 cores with N=2, one
    thread each). Every rank is on this host: the group's sockets listen on loopback only."""
    _sockets_on_loopback()
    if device == "cuda":
        index = cuda_device_for_rank(rank, size, torch.cuda.device_count(), _launcher_local_rank(rank))
        torch.cuda.set_device(index)
        backend, dev = "nccl", torch.device("cuda", index)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size * num_engine_cores)))
        backend, dev = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            device_id=dev if backend == "nccl" else None)
    return dev


def init_data_parallel_experts(rank: int, size: int, store_file: str,
                               timeout_s: float) -> TensorParallel:
    """DP+EP: join the group of this host's `size` engine cores as data-parallel `rank` (gloo on
    the CPU), and return the TensorParallel that names this rank's experts. The group meets
    through `store_file` in the API server's private directory (mode 0700), not a TCP store,
    which would listen on every interface, unauthenticated. A collective waits at most
    `timeout_s` (engine_iteration_timeout_s) for a peer, so a survivor of a dead rank fails
    instead of waiting forever."""
    _sockets_on_loopback()
    dist.init_process_group("gloo", store=dist.FileStore(store_file, size), rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s))
    return TensorParallel(enable_expert_parallel=True, expert_exchange=ExpertExchange(rank, size))


def _sockets_on_loopback() -> None:
    """Every rank is on this host: the group's own sockets listen on loopback only (gloo would
    take the address the hostname resolves to, NCCL's bootstrap the first network interface;
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when set, still win)."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = "lo0" if "lo0" in names else "lo"      # BSD and macOS, Linux
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
