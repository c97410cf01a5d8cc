"""Silent-data-corruption checks for any PyTorch DistributedDataParallel loop.

Three checks, after the production recipe (non-finite gradients, ring replay audit, weight
fingerprints), each naming the suspect rank(s) and their hosts::

    ddp = DistributedDataParallel(model)
    guard = sdc.Guard(ddp, policy="stop", events="sdc.jsonl", audit_every=50,
                      save=lambda path: torch.save(model.state_dict(), path))
    for step, batches in enumerate(loader):           # batches[r]: rank r's micro-batch
        guard.begin_step(step)
        loss_fn(ddp, batches[rank]).backward()           # gradient hooks check local gradients
        if guard.check_gradients(replay=lambda r: loss_fn(guard.module, batches[r])):
            optimizer.step()                             # skipped on non-finite gradients
        guard.check_weights()                            # compared during the next step
        optimizer.zero_grad(set_to_none=True)
    guard.finish()

Every rank takes the same decision from the same all-gathered data, so with policy ``stop``
all ranks exit together (``EXIT_SDC`` when a faulty rank is localized, else ``EXIT_SDC_UNLOCALIZED``)
and no rank is left waiting in a collective.
"""

from __future__ import annotations

import cmath
import json
import math
import numbers
import os
import socket
import sys
import time
import weakref
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import tensor_stats
from .io import PeatError, check_int

EXIT_SDC = 75  # EX_TEMPFAIL: "try again later" - requeue the job on healthy nodes
# Detected, but no rank to blame (a divergence, two replicas): a requeue would only repeat it, so a
# human must look. 65 (EX_DATAERR) is clear of Python's 1/2/120, torchrun's 1 and signals' 128+N.
EXIT_SDC_UNLOCALIZED = 65
POLICIES = ("raise", "log", "stop")
CHECKS = ("nonfinite", "audit", "fingerprint")
TIMED_STEPS = 1000  # each check's times kept for ``Guard.costs``: a guard lives for the whole training
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GUARDS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(model) -> the guard that checks it


class SDCError(RuntimeError):
    """Raised by policy ``raise``; ``event`` is the alarm."""

    def __init__(self, event: "Event"):
        super().__init__(event.message())
        self.event = event


class CollectiveFailed(PeatError):
    """A collective of the guard's failed: a peer died or hung past the timeout (not this rank's fault)."""


class StopFailed(PeatError):
    """Policy ``stop`` could not be carried out: a rank's ``save`` (or its drain marker) raised. Raised on
    every rank, at once: ``own`` on the rank whose part failed (chained to its error), else its peer's."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


@dataclass
class Event:
    """One alarm: the same on every rank."""

    step: int
    check: str
    suspect_ranks: list[int]
    hosts: list[str]
    localized: bool
    detail: dict = field(default_factory=dict)
    time: float = 0.0

    def message(self) -> str:
        where = "localized" if self.localized else "NOT localized"
        # The note says why nothing is localized (the run diverged, two replicas, ...): the one line
        # printed and raised must say it, not only the events file.
        why = f": {self.detail['note']}" if "note" in self.detail else ""
        return (f"silent data corruption suspected at step {self.step} by check '{self.check}': "
                f"rank(s) {self.suspect_ranks} on node(s) {', '.join(self.hosts)} ({where}{why})")


# --- fingerprints -------------------------------------------------------------------------------

def checksum(tensors) -> torch.Tensor:
    """Exact integer checksum per tensor: wrap-around sum of its bytes read as integer words.

    The words are 64-bit wherever the tensor's bytes allow it (half the additions of 32-bit
    words), else as wide as one element. Any single bit flip changes one word by +-2^k, k below
    the word width, which is never 0 modulo 2^width: always caught. One read pass, as cheap as a
    float sum.
    """
    sums = []
    for t in tensors:
        words = _words(t.detach().reshape(-1))
        sums.append(words.sum(dtype=words.dtype))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    if any(s.dtype != torch.int64 for s in sums):
        sums = [s.to(torch.int64) for s in sums]
    return torch.stack(sums)


def group_checksums(tensors) -> torch.Tensor:
    """``checksum`` of runs of consecutive tensors whose words (``_words``) are alike, up to
    ``tensor_stats.BATCH_ELEMENTS`` elements (or one larger tensor): each run's words concatenated
    and summed at once, two kernel launches per run where ``checksum`` takes one per tensor. As
    exact: a single bit flip changes a run's sum by +-2^k, k below 64, never 0 modulo 2^64.
    """
    words = [_words(t.detach().reshape(-1)) for t in tensors]
    if not words:
        return torch.zeros(0, dtype=torch.int64)
    runs = tensor_stats.batches(words, tensor_stats.BATCH_ELEMENTS, key=lambda w: w.dtype)
    return torch.stack([torch.cat(run).sum(dtype=torch.int64) for run in runs])


def _words(flat: torch.Tensor) -> torch.Tensor:
    # The word width depends on the element count only, never on the memory layout, so that
    # replicas with equal values always have equal checksums.
    size = flat.element_size()
    if size == 8 or (flat.numel() * size) % 8:
        return flat.view(_INT_OF_SIZE[size])
    if (flat.storage_offset() * size) % 8:
        flat = flat.clone()  # an unaligned view (rare): 64-bit words need aligned memory
    return flat.view(torch.int64)


def norms(tensors) -> torch.Tensor:
    """Float64 sum of squares per tensor, stored bit-for-bit in int64 so it travels with checksums."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([t.detach().double().square().sum() for t in tensors]).view(torch.int64)


def gradient_fingerprint(grads) -> torch.Tensor:
    """``[checksums..., norms...]`` of a list of gradients: what the ring audit compares."""
    grads = [_canonical(g.detach()) for g in grads]
    return torch.cat([checksum(grads), norms(grads)])


def _canonical(grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:  # nn.Embedding(sparse=True): as dense, its repeated rows summed in one order
        grad = grad.coalesce().to_dense()
    grad = _real(grad)
    # -0.0 and +0.0 as one: a gradient accumulated into a zeroed .grad (zero_grad(set_to_none=False))
    # turns autograd's -0.0 into 0 + -0.0 = +0.0, which the replay's fresh gradient keeps as -0.0.
    return grad + 0.0


def fingerprints_match(a: torch.Tensor, b: torch.Tensor, tolerance: float = 0.0) -> bool:
    """Compare two gradient fingerprints ``[checksums..., norms...]``.

    ``tolerance`` 0: bit-exact (same machine, same threads, deterministic kernels). Above 0: the
    relative difference of each tensor's norm may be up to ``tolerance`` (replay on other hardware,
    non-deterministic GPU reductions); the checksums are then ignored.
    """
    if tolerance == 0:
        return bool(torch.equal(a, b))
    half = a.numel() // 2
    # The fingerprints hold sums of squares: their square roots are the norms the tolerance is on.
    na, nb = a[half:].view(torch.float64).sqrt(), b[half:].view(torch.float64).sqrt()
    if not (torch.isfinite(na).all() and torch.isfinite(nb).all()):
        return bool(torch.equal(a, b))
    scale = torch.maximum(na.abs(), nb.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    return bool(((na - nb).abs() / scale <= tolerance).all())


def majority_outliers(fingerprints: list) -> tuple[list[int], bool]:
    """Ranks outside the strict majority of identical fingerprints, and whether that localizes.

    Two replicas that differ, or no strict majority, cannot say who is wrong: every rank is
    returned and ``localized`` is False.
    """
    keys = [tuple(torch.as_tensor(f).tolist()) for f in fingerprints]
    (common, count), = Counter(keys).most_common(1)
    if count == len(keys):
        return [], True
    if count * 2 > len(keys):
        return [r for r, k in enumerate(keys) if k != common], True
    return list(range(len(keys))), False


def ring_suspects(failed: list[tuple[int, int]], world: int) -> tuple[list[int], bool]:
    """Localize from failed audits ``(auditor, audited)`` on the ring r -> (r+1) mod W.

    A rank that computes wrongly fails the audit of its own report and its own audit of the
    next rank; ranks in two failed audits are the suspects. A single failed audit cannot tell
    auditor from audited (resolved by a third rank's replay, see ``Guard``); with W=2 both audits involve both
    ranks, so nothing can be localized.
    """
    if not failed:
        return [], True
    if world == 2:
        return [0, 1], False
    seen = Counter(r for pair in failed for r in pair)
    twice = sorted(r for r, n in seen.items() if n >= 2)
    if twice and len(twice) * 2 < world:
        return twice, True
    return sorted(seen), False


def shard(indices, rank: int, world: int):
    """Rank ``rank``'s micro-batch of a global batch: a contiguous slice any rank can rebuild."""
    n = len(indices)
    return indices[rank * n // world:(rank + 1) * n // world]


def node_name() -> str:
    """The name a scheduler knows this node by (SLURM's node name when under SLURM)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# --- the guard ----------------------------------------------------------------------------------

class Guard:
    """The three checks on one DDP model; see the module docstring for the loop."""

    def __init__(self, ddp, *, policy: str = "log", events: str | os.PathLike | None = None,
                 audit_every: int = 0, fingerprint_every: int = 1, audit_tolerance: float = 0.0,
                 save: Callable[[Path], None] | None = None, checkpoint: str | os.PathLike = "sdc_stop.pt",
                 drain_marker: str | os.PathLike | None = None, fused: bool | None = None, group=None):
        if policy not in POLICIES:
            raise PeatError(f"sdc policy {policy!r} is unknown; allowed: {', '.join(POLICIES)}")
        if not isinstance(ddp, DistributedDataParallel):  # the audit needs its module and no_sync()
            raise PeatError(f"sdc.Guard: pass the DistributedDataParallel wrapper, DDP(model), not a {type(ddp).__name__}")
        check_int("sdc.Guard: audit_every", audit_every, 0, "every N steps needs an integer N >= 0 (0 = off)")
        check_int("sdc.Guard: fingerprint_every", fingerprint_every, 1, "every N steps needs an integer N >= 1")
        if save is not None and not callable(save):  # else a TypeError at the first stop, the peers in its barrier
            raise PeatError(f"sdc.Guard: save={save!r}: pass a function that writes the checkpoint to the path it is "
                            "given (checkpoint= names that path)")
        # Else '1e-5' (YAML's reading of 1e-5) crashed the first audit step, and a negative one failed every audit.
        if (isinstance(audit_tolerance, bool) or not isinstance(audit_tolerance, numbers.Real)
                or not 0 <= audit_tolerance < math.inf):
            raise PeatError(f"sdc.Guard: audit_tolerance={audit_tolerance!r}: a relative tolerance needs a finite "
                            "number >= 0 (0 = bit-exact)")
        # The replicas are DDP's group: over the whole world, a DDP in a subgroup (another parallel dimension
        # beside it) was compared with models that are not its replicas, an alarm at every step.
        group = ddp.process_group if group is None else group
        self.ddp, self.module, self.group = ddp, ddp.module, group
        self.policy, self.events, self.save = policy, events, save
        self.checkpoint, self.drain_marker = Path(checkpoint), drain_marker
        self.audit_every, self.fingerprint_every, self.tolerance = audit_every, fingerprint_every, float(audit_tolerance)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # DDP never syncs the parameters it ignores (delayed ones aside: reduced after the backward), so
        # replicas may differ there by design: their weights compared as replicas raised an alarm at every
        # step, and a NaN in one rank's gradient, never shared, sent that rank alone into the flag exchange.
        delayed = {id(p) for p in getattr(ddp, "_delay_all_reduce_params", ())}
        ignored = getattr(ddp, "parameters_to_ignore", ())
        self._replicated = [(n, p) for n, p in self.module.named_parameters() if n not in ignored or id(p) in delayed]
        self.params = [p for _, p in self._replicated if p.requires_grad]
        if not self.params:
            raise PeatError("sdc.Guard: the model has no trainable parameters")
        self.device = self.params[0].device  # nccl gathers need device tensors
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.fused = self._fusable(fused)
        # Ranks whose guards differ run different collectives at the same step: gloo aborted the
        # process with a size mismatch (or a garbage random state), nccl may hang.
        alike = {"policy": policy, "audit_every": int(audit_every), "fingerprint_every": int(fingerprint_every),
                 "audit_tolerance": float(audit_tolerance), "trainable parameters": len(self.params),
                 "fused": self.fused}
        ranks: list = [None] * self.world
        # A file one node cannot write is refused on every rank: raised on that rank alone, its peers waited here.
        saved = checkpoint if policy == "stop" and save is not None else None  # saved by a healthy rank at a stop
        node = node_name()
        self._marker, problem = _files_to_write(events, drain_marker, saved, node)  # the marker _stop writes
        self._collective("guard settings", dist.all_gather_object, ranks, (node, alike, problem), group=group)
        self.hosts = [host for host, _, _ in ranks]
        for r, (host, _, problem) in enumerate(ranks):
            if problem:
                raise PeatError(f"sdc.Guard: {problem} (rank {r} on node {host})")
        for key, value in alike.items():
            if any(other[key] != value for _, other, _ in ranks):
                values = ", ".join(f"rank {r}: {other[key]!r}" for r, (_, other, _) in enumerate(ranks))
                raise PeatError(f"sdc.Guard: {key} differs between ranks ({values}): build the guard alike on every rank")
        self.alarms: list[Event] = []
        # The last TIMED_STEPS times of each check: kept for every step, they grew without bound (a float a
        # check and step). ``spent`` is the total, for a caller timing its step without the checks.
        self.timers: dict[str, deque] = {c: deque(maxlen=TIMED_STEPS) for c in CHECKS}
        self.spent = 0.0
        self.step = -1
        # Gradient (or bucket) hook calls since begin_step (None: no step begun), and whether check_gradients
        # ran: a call out of order (no begin_step, check before backward) is one line, not a false alarm.
        self._fired, self._checked, self._weights_due, self._weighed = None, False, False, False
        self._weights = None  # (step, pending gather) of the last weight checksums
        self._retired = False  # replaced by a guard built later for the same model (_take_over)
        self._replaying = False  # see _backward
        self._last_synced = None  # whether the last backward's forward was outside no_sync()
        # The last forward with autograd on: outside no_sync(), and whether no gradient came since. It
        # counts at its backward only: a forward for logging (under no_sync()) before the check is no step.
        self._forward_synced, self._new_forward = None, False
        self._accumulated: set[int] = set()  # id of each parameter whose gradient the last backward gave
        self._take_over()
        if self.fused:
            # DDP's comm hook sees each bucket's local gradients before they are shared: the check then
            # costs a few kernel launches per bucket, where the gradient hooks cost two per parameter.
            ddp.register_comm_hook(None, self._on_bucket)
            # DDP takes one comm hook: a user's registered after this one failed with DDP's "can only be
            # called once", which names no guard (fused is the default on a GPU).
            ddp.register_comm_hook = ddp._register_builtin_comm_hook = self._refuse_comm_hook
            self._grad_storage: dict[int, int] = {}  # id(param) -> its .grad's storage as last accumulated
            # DDP scales a gradient accumulated in its own bucket view unlike one it copies in, and
            # only this hook can tell which (DDP points every .grad to its view before the comm hook).
            self._in_views = ddp.gradient_as_bucket_view and not getattr(ddp, "batched_grad_copy", False)
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_accumulated) for p in self.params]
        else:
            # Post-accumulate hooks run on each local gradient before DDP's own hook copies it into its
            # bucket for the all-reduce: DDP keeps its fused C++ path and the comm hook stays free.
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self._hooks.append(ddp.register_forward_pre_hook(self._on_forward))

    def _fusable(self, fused: bool | None) -> bool:
        """Whether the checks run fused: the local gradient checks per DDP bucket (a comm hook of the
        guard's) rather than per parameter (gradient hooks), the weight checksums per group of
        parameters rather than per parameter.

        By default on a GPU only: there a step is bound by kernel launches, and the checks per
        parameter launch three per parameter. On a CPU the reads cost, and fusing costs more passes:
        DDP copies the gradients into a comm hook's buckets unscaled, and the hook scales them; the
        grouped checksums copy the weights before summing them.
        """
        taken = self._has_comm_hook()  # the user's (no guard has registered its own yet)
        sparse = any(getattr(m, "sparse", False) for m in self.module.modules())  # DDP buckets those alone
        # DDP reduces these outside its buckets (delay_all_reduce_named_params, or not at all): the comm
        # hook never sees them, so their NaN reached every replica unseen and the audit had no report.
        ignored = getattr(self.ddp, "parameters_to_ignore", ())
        apart = [n for n, p in self._replicated if p.requires_grad and n in ignored]
        if fused and (taken or sparse or apart):
            why = ("the DDP model has a comm hook already" if taken else "the model has sparse gradients" if sparse
                   else f"DDP reduces trainable parameters outside its buckets ({', '.join(apart)})")
            raise PeatError(f"sdc.Guard: fused=True needs DDP's comm hook, but {why}: pass fused=False")
        if fused is None:
            return self.device.type == "cuda" and not (taken or sparse or apart)
        return bool(fused)

    def _refuse_comm_hook(self, *_args, **_kwargs):
        raise PeatError("sdc.Guard: the guard's fused checks hold DDP's comm hook, which DDP takes once: register "
                        "yours before building the guard (it then checks per parameter), or build the guard with "
                        "fused=False")

    def _take_over(self) -> None:
        # A guard rebuilt for the same model (with a new DDP after unfreezing layers) replaces the last
        # one: that one's hooks, left on the parameters, refused the first backward as coming after its
        # own last step.
        previous = _GUARDS.get(id(self.module))
        if previous is not None and previous.module is self.module:
            previous._remove_hooks()
            previous._retired = True  # a comm hook cannot be removed: it only shares gradients from now on
        _GUARDS[id(self.module)] = self

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # - per step -

    def begin_step(self, step: int) -> None:
        self._require_checks(f"begin_step({step})")
        self.step, self._fired, self._checked, self._weights_due = step, 0, False, False
        self._weighed = False  # check_weights() ran in this step
        self._synced_at = None  # gradient hook calls at the step's last forward with gradient sync
        self._forward_after_check = False  # a gradient after check_gradients() then came from a new forward
        self._reported: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # This rank's non-finite flag: a bool on CPU; elsewhere (no host sync in backward) the float64
        # sums of its local gradients, non-finite where a gradient is (``_flagged`` reads them).
        self._bad = False if self.device.type == "cpu" else []
        self._buckets = []  # fused: this step's buckets, a rank's mark at their first element
        self._hook_time = 0.0
        # The audit's share of the hooks (each local gradient's report): timed as the audit's, not as the
        # non-finite check's, which showed a third of a step on audit steps (resnet18, audit_every 2).
        self._report_time = 0.0
        self._auditing = self.audit_every > 0 and step % self.audit_every == 0
        # Replays must see the random state the peer's forward saw (dropout masks): each rank's
        # travels with its audit fingerprint (ranks seeded apart or drawing for uneven shards differ).
        self._rng = _rng_state(self.device) if self._auditing else None
        # ... and the buffers it started from (spectral norm's power iteration updates and uses them).
        self._buffers = _buffers(self.module) if self._auditing else None

    def _on_forward(self, module, args) -> None:
        # DDP all-reduces in the backward of each forward made with gradient sync: a second one in a step
        # adds its local gradients to already reduced ones, so every audit failed on every rank and a NaN
        # reached every rank's local check (an unlocalized alarm, the faulty rank unnamed). Forwards with
        # no gradient between them (a siamese or contrastive loss: two calls, one backward) are one all-reduce.
        if self.ddp._join_config.enable:
            # A rank that ran out of inputs shadows DDP's collectives only: its peers' checks then waited in
            # gathers it never joins, until the timeout, with gloo's or nccl's error and no word of the guard.
            raise PeatError("sdc.Guard: DDP's join() (uneven inputs) cannot be guarded: a rank that has joined "
                            "runs none of the guard's collectives; give every rank the same number of steps "
                            "(drop or pad the last uneven batches)")
        if torch.is_grad_enabled():
            self._forward_synced, self._new_forward = self.ddp.require_backward_grad_sync, True
            self._forward_after_check = self._checked
        if self._fired is None or self._checked or not (torch.is_grad_enabled() and self.ddp.require_backward_grad_sync):
            return
        if self._synced_at is not None and self._fired > self._synced_at:
            raise PeatError(f"sdc.Guard: a second DDP forward with gradient sync in step {self.step}: accumulate "
                            "micro-batches under ddp.no_sync(), all but the last")
        self._synced_at = self._fired

    def _on_gradient(self, param: torch.Tensor) -> None:
        """This rank's own gradient of ``param``, before it is shared: fingerprint it for the audit,
        then check it. A non-finite one also gets NaN at its first element (it is garbage already
        and the step will be skipped), so that after the all-reduce every rank finds out from that
        one element of the reduced gradient, without exchanging flags on healthy steps.
        """
        if self._replaying:
            return
        grad = param.grad.detach()
        self._check_local([(param, grad)], grad)
        self._once(param)

    def _on_bucket(self, _state, bucket):  # unannotated: DDP checks annotations against live types
        """DDP's comm hook (``fused``): ``_on_gradient`` on a whole bucket (``dist.GradBucket``) of
        this rank's local gradients, its mark at the bucket's first element, then DDP's own mean over
        the ranks (a future of the reduced bucket)."""
        buffer = bucket.buffer()
        if not self._retired:
            self._check_local(_bucket_gradients(bucket, buffer), buffer)
            self._buckets.append(buffer)  # reduced in place: read by _reduced_nonfinite
        group = self.ddp.process_group
        self._scale_as_ddp(bucket, buffer, dist.get_world_size(group))
        return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])

    def _on_accumulated(self, param: torch.Tensor) -> None:
        if self._replaying:
            return
        # A backward the comm hook never sees (a second one through a retained graph: DDP all-reduces once
        # per forward) added this rank's unshared gradient after the check: replicas parted, and the next
        # weight fingerprint raised a false alarm naming every rank.
        if self._fired is None or self._checked:
            self._arrived()
        self._once(param)
        if self._in_views:
            self._grad_storage[id(param)] = param.grad.untyped_storage().data_ptr()

    def _once(self, param: torch.Tensor) -> None:
        # A second backward through one forward with gradient sync (two losses, retain_graph=True) is
        # never all-reduced: each rank added its own gradients, the replicas parted, and the next weight
        # fingerprint raised a false alarm naming every rank.
        if self._new_forward:  # the first gradient of the last forward's backward
            self._last_synced, self._new_forward, self._accumulated = self._forward_synced, False, set()
        if self._last_synced and id(param) in self._accumulated:
            raise PeatError(f"sdc.Guard: a second backward through one forward with gradient sync in step "
                            f"{self.step}: DDP all-reduces only the first, so the replicas would part; add the "
                            "losses and call backward() once")
        self._accumulated.add(id(param))

    def _scale_as_ddp(self, bucket, buffer: torch.Tensor, world: int) -> None:
        """Scale a bucket as DDP's own all-reduce does before summing, bit for bit: x * (1/3) and x / 3
        round differently. DDP multiplies each gradient by the reciprocal as it copies it into the
        bucket, but divides one accumulated in place in its bucket view (``gradient_as_bucket_view``
        with ``.grad`` kept between steps), and with ``batched_grad_copy`` divides the whole bucket."""
        if getattr(self.ddp, "batched_grad_copy", False):
            buffer.div_(world)
            return
        # Only with gradient_as_bucket_view are there gradients DDP accumulated in its views.
        storage = buffer.untyped_storage().data_ptr() if self._grad_storage else None
        in_view = [self._grad_storage.get(id(p)) == storage for p in bucket.parameters()] if storage else []
        if not any(in_view):
            buffer.mul_(1.0 / world)
        elif all(in_view):
            buffer.div_(world)
        else:
            for (_, grad), divided in zip(_bucket_gradients(bucket, buffer), in_view):
                grad.div_(world) if divided else grad.mul_(1.0 / world)

    def _check_local(self, grads, marked: torch.Tensor) -> None:
        """This rank's local gradients ``(param, grad)``, before they are shared: reported for the audit
        on audit steps, then checked as ``marked`` (the gradient, or their bucket), marked if non-finite."""
        self._arrived()
        t0 = time.perf_counter()
        if self._auditing:
            for param, grad in grads:
                self._reported[self._index[id(param)]] = tuple(gradient_fingerprint([grad]))
            t1 = time.perf_counter()
            self._report_time += t1 - t0
            t0 = t1
        self._bad = _mark_nonfinite(marked, self._bad)
        self._hook_time += time.perf_counter() - t0

    def _arrived(self) -> None:
        """A gradient (or a bucket) of this rank arrived: refused out of order, else counted."""
        if self._fired is None:
            raise PeatError("sdc.Guard: a gradient arrived before begin_step(): call guard.begin_step(step) "
                            "before each step's backward, and check_gradients() after it")
        if self._checked and not self._forward_after_check:  # through the checked step's graph, retained
            raise PeatError(f"sdc.Guard: a second backward in step {self.step} after its check_gradients(): its "
                            "gradients were never checked, nor shared (DDP all-reduces once per forward); "
                            "backpropagate each step's loss once, before check_gradients()")
        if self._checked:  # the next step's without its begin_step, or a micro-batch after the check
            raise PeatError(f"sdc.Guard: a gradient arrived after check_gradients() of step {self.step}: every "
                            "backward of a step comes before its check_gradients(); call guard.begin_step(step) "
                            "before the next step's")
        self._fired += 1

    def check_gradients(self, replay: Callable[[int], torch.Tensor] | None = None) -> bool:
        """After backward, before ``optimizer.step()``: find out whether any rank had non-finite
        gradients (and which), and run the ring audit when due (``replay(r)``, rank r's loss, is then
        required). Returns False when the step must be skipped (non-finite gradients).
        """
        if self._checked:  # its alarm was raised (and written to the events file) once more, its audit rerun
            raise PeatError(f"sdc.Guard: check_gradients() called twice in step {self.step}: call it once per step, "
                            "and keep its verdict")
        # A backward under no_sync() alone is never all-reduced: each rank read its own unshared gradients
        # as reduced ones, so a rank's NaN sent it alone into the flag exchange (gloo aborted, nccl hangs),
        # and fused checks never saw it ("no gradient").
        if self._last_synced is False:
            raise PeatError(f"sdc.Guard: step {self.step}'s last backward ran under ddp.no_sync(): its gradients were "
                            "never shared between ranks, so no check can compare them; run each step's last "
                            "micro-batch outside no_sync()")
        if not self._fired:  # else the audit compares no report with the replay: a false alarm on every rank
            raise PeatError(f"sdc.Guard: check_gradients() at step {self.step} saw no gradient of this step: "
                            "call guard.begin_step(step) before backward and check_gradients() after it")
        if self._auditing and replay is None:  # else the configured audit never runs, without a word
            raise PeatError(f"sdc.Guard: step {self.step} is an audit step (audit_every={self.audit_every}) but "
                            "check_gradients() got no replay: pass replay=lambda r: <rank r's loss>, or audit_every=0")
        self._checked = True
        self._settle()
        self._resolve_weights()
        t0 = time.perf_counter()
        # The reduced gradients are the same bits on every rank: all ranks take the same branch.
        healthy = not self._reduced_nonfinite()
        if not healthy:
            self._localize_nonfinite()
        self._timed("nonfinite", self._hook_time + time.perf_counter() - t0)
        if healthy and self._auditing:
            t0 = time.perf_counter()
            gathered = self._all_gather(torch.cat([self._reported_fingerprint(), self._rng.to(self.device)]),
                                        "audit fingerprints")
            cut = 2 * len(self.params)
            self._audit(replay, [g[:cut] for g in gathered], [g[cut:] for g in gathered],
                        self._report_time + time.perf_counter() - t0)
        else:  # a skipped step's reports: no audit ran, but the time was the guard's
            self.spent += self._report_time
        self._weights_due = healthy  # a skipped step changed no weight: its check_weights() may be left out
        return healthy

    def _require_checks(self, call: str) -> None:
        # A step without its checks passed without a word: a NaN trained into every replica (which
        # then agree), a bit flip never compared, the audit never run.
        if self._fired and not self._checked:
            raise PeatError(f"sdc.Guard: {call} after step {self.step} had gradients but no check_gradients(): "
                            "call it after each step's backward, before optimizer.step()")
        if self._weights_due:
            raise PeatError(f"sdc.Guard: {call} after step {self.step} had no check_weights(): call it after each "
                            "step's optimizer.step()")

    def _reduced_nonfinite(self) -> bool:
        """Whether an all-reduced gradient is non-finite: at its first element, where NaN marks a rank's
        non-finite local gradient (``_on_gradient``), or anywhere when the all-reduce itself may overflow."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and self._reduction_may_overflow(grads):  # fused: the buckets hold the same values, fewer tensors
            return _any_nonfinite(self._buckets if self.fused else grads)
        firsts = [b[:1] for b in self._buckets] if self.fused else [_marks(g) for g in grads]
        if len({f.dtype for f in firsts}) > 1:
            firsts = [f.double() for f in firsts]  # every float type fits: no spurious overflow
        return bool(firsts) and not bool(torch.isfinite(torch.cat(firsts)).all())

    def _reduction_may_overflow(self, grads) -> bool:
        # DDP's own all-reduce sums gradients already divided by the world size: finite float32 ones
        # overflow it only by rounding within a few ulps of 3.4e38 (garbage already), so the first
        # elements are all to read (no pass over the gradients on healthy steps). Float16 ones reach their
        # top (65504 / 3 rounds up to 21840: three of them overflow), bfloat16 rounds coarsely, and a comm
        # hook may overflow anywhere (fp16 compression above 65504, a plain sum): every element is read.
        # DDP logs the name of any comm hook: built-in, Python, its own for mixed precision.
        # The guard's own (fused) reduces as DDP's built-in all-reduce does.
        return any(g.dtype in (torch.float16, torch.bfloat16) for g in grads) or (self._has_comm_hook() and not self.fused)

    def _has_comm_hook(self) -> bool:
        # DDP logs the name of any comm hook. That log is a prototype API: where a torch lacks it,
        # a hook is assumed (one pass more, no miss).
        logged = getattr(self.ddp, "_get_ddp_logging_data", None)
        return logged is None or bool(logged().get("comm_hook"))

    def _localize_nonfinite(self) -> None:
        local = torch.tensor([int(_flagged(self._bad))], device=self.device)
        flags = [int(f) for f in self._all_gather(local, "gradient flags")]
        suspects = [r for r, f in enumerate(flags) if f]
        if suspects and len(suspects) < self.world:
            self._alarm("nonfinite", suspects, True, {"flags": flags})
        elif suspects:  # the same fault on every replica is the run's (divergence, bad data), not a GPU's
            note = ("one rank: no peer to tell a faulty device from a diverged run or bad data" if self.world == 1
                    else "every rank has non-finite gradients: the run diverged or the data is bad; no faulty rank")
            self._alarm("nonfinite", suspects, False, {"flags": flags, "note": note})
        else:  # finite local gradients whose sum overflowed in the all-reduce: no rank to blame
            self._alarm("nonfinite", list(range(self.world)), False,
                        {"flags": flags, "note": "only the all-reduced gradient is non-finite (overflow in the sum)"})

    def check_weights(self) -> None:
        """After ``optimizer.step()``: start the exchange of exact weight checksums. It completes,
        and a mismatch is reported for this step, in the next ``check_gradients`` (before the next
        update) or in ``finish()``, so the exchange never stalls the loop.
        """
        if self._weighed:  # its gather was settled early (a stall) and a mismatch raised two alarms
            raise PeatError(f"sdc.Guard: check_weights() called twice in step {self.step}: call it once per step, "
                            "after optimizer.step()")
        self._resolve_weights()
        self._weights_due, self._weighed = False, True
        if self.step % self.fingerprint_every:
            return
        t0 = time.perf_counter()
        # Frozen parameters too: nothing re-syncs them, so a flip in one stays in that replica.
        params = [p for _, p in self._replicated]
        weights = (group_checksums(params) if self.fused else checksum(params)).to(self.device)
        self._weights = (self.step, self._start_gather(weights, "weight fingerprints"))
        self._timed("fingerprint", time.perf_counter() - t0)

    def finish(self) -> None:
        """After the last step: settle the last weight comparison."""
        self._require_checks("finish()")
        self._settle()
        self._resolve_weights()

    def _settle(self) -> None:
        # On a GPU the step's backward is still queued here, and the checks' first reads wait for it:
        # their timers counted that wait as their cost. The reads wait anyway, so waiting first is free.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _resolve_weights(self) -> None:
        if self._weights is None:
            return
        t0 = time.perf_counter()
        (step, pending), self._weights = self._weights, None
        prints = self._finish_gather(pending)
        suspects, localized = majority_outliers(prints)
        self._timed("fingerprint", time.perf_counter() - t0, same_step=True)
        if suspects:
            if self.fused:  # the groups' checksums tell which ranks differ; each tensor's, where
                prints = self._all_gather(checksum([p for _, p in self._replicated]).to(self.device),
                                          "weight fingerprints per tensor")
            names = [n for n, _ in self._replicated]
            first = next((n for i, n in enumerate(names) if len({int(p[i]) for p in prints}) > 1), None)
            detail = {"first_differing_parameter": first}
            if first is None:  # fused: the groups' checksums differed, each tensor's (computed after) do not
                detail["transient"] = ("each tensor's checksum agrees when read again: a wrong read or sum of "
                                       "the weights, not their bits")
            if not localized:
                detail["note"] = self._unlocalized("no majority of identical replicas")
            self._alarm("fingerprint", suspects, localized, detail, step)

    # - ring audit -

    def _reported_fingerprint(self) -> torch.Tensor:
        zeros = torch.zeros((), dtype=torch.int64)
        parts = [self._reported.get(i, (zeros, zeros)) for i in range(len(self.params))]
        return torch.cat([torch.stack([c for c, _ in parts]), torch.stack([n for _, n in parts])]).to(self.device)

    def _audit(self, replay, reported: list[torch.Tensor], rng: list[torch.Tensor], before: float = 0.0) -> None:
        """The ring audit of this step; ``before``: seconds it took already (reports, their gather)."""
        t0 = time.perf_counter()
        peer = (self.rank + 1) % self.world
        mine = self._replay(replay, peer, rng[peer])
        agrees = [int(v) for v in self._all_gather(
            torch.tensor([int(fingerprints_match(mine, reported[peer], self.tolerance))], device=self.device),
            "audit verdicts")]
        failed = [(r, (r + 1) % self.world) for r, ok in enumerate(agrees) if not ok]
        suspects, localized = ring_suspects(failed, self.world)
        detail = {"failed_audits": failed}
        if len(failed) == 1 and self.world > 2:
            (auditor, audited), third = failed[0], (failed[0][1] + 1) % self.world
            suspects, localized = self._second_opinion(replay, auditor, audited, third, reported, rng), True
            detail["rerun"] = f"rank {third} also replayed rank {audited}'s micro-batch"
        self._timed("audit", before + time.perf_counter() - t0)
        if suspects:
            if not localized:
                detail["note"] = self._unlocalized("failed audits have no common rank")
            self._alarm("audit", suspects, localized, detail)

    def _unlocalized(self, why: str) -> str:
        return f"{'two replicas' if self.world == 2 else why}: detected but cannot localize"

    def _second_opinion(self, replay, auditor: int, audited: int, third: int, reported, rng) -> list[int]:
        """One failed audit: a third rank replays the audited rank's micro-batch too. Agreeing with
        the audited rank's report means the auditor's replay was wrong; differing means the report was
        (a transient fault, or one the audited rank repeats on its own data: a rerun there would agree).
        """
        same = torch.tensor([1], device=self.device)
        if self.rank == third:
            same[0] = int(fingerprints_match(self._replay(replay, audited, rng[audited]), reported[audited], self.tolerance))
        src = dist.get_global_rank(self.group or dist.group.WORLD, third)  # broadcast takes a global rank
        self._collective("audit second opinion", dist.broadcast, same, src, group=self.group)
        return [auditor] if int(same) else [audited]

    def _replay(self, replay, rank: int, rng: torch.Tensor) -> torch.Tensor:
        """Fingerprint of the gradients of ``rank``'s micro-batch, computed here from the current
        (pre-step) weights and buffers and ``rank``'s random state of the step, without DDP hooks
        and without touching .grad, buffers or this rank's RNG stream.
        """
        buffers = _buffers(self.module)
        _set_buffers(self.module, self._buffers)
        after = _rng_state(self.device)
        _set_rng_state(rng, self.device)
        try:
            with self.ddp.no_sync():
                loss = replay(rank)
                # Parameters frozen since the guard was built report no gradient (zeros), as here.
                trained = [p for p in self.params if p.requires_grad]
                nodes = _graph(loss)
                # torch.utils.checkpoint(use_reentrant=True) runs a backward of its own, into .grad, where
                # autograd.grad refuses it, or skips it with no path from a parameter into the checkpoint
                # (the gradients of the parameters inside it were then zeros): a crash or a false alarm.
                if any(type(node).__name__ == "CheckpointFunctionBackward" for node in nodes):
                    leaves = trained + [n.variable for n in nodes if type(n).__name__ == "AccumulateGrad"]
                    grads = self._backward(loss, leaves)
                else:
                    grads = torch.autograd.grad(loss, trained, allow_unused=True)
                grads = dict(zip(map(id, trained), grads))
        finally:
            _set_rng_state(after, self.device)
            _set_buffers(self.module, buffers)
        return gradient_fingerprint([torch.zeros_like(p) if grads.get(id(p)) is None else grads[id(p)]
                                     for p in self.params])

    def _backward(self, loss: torch.Tensor, leaves: list) -> list:
        """The gradients of ``loss`` for ``leaves`` (the first ones: the rest only keep their ``.grad``)
        by ``loss.backward()``, each leaf's ``.grad`` emptied before and restored after, the guard's
        gradient hooks muted meanwhile."""
        kept = [leaf.grad for leaf in leaves]
        self._replaying = True
        try:
            for leaf in leaves:
                leaf.grad = None
            loss.backward()
            return [leaf.grad for leaf in leaves]
        finally:
            self._replaying = False
            for leaf, grad in zip(leaves, kept):
                leaf.grad = grad

    # - alarms -

    def _alarm(self, check: str, suspects: list[int], localized: bool, detail: dict, step: int | None = None) -> None:
        hosts = sorted({self.hosts[r] for r in suspects})
        event = Event(self.step if step is None else step, check, suspects, hosts, localized, detail, time.time())
        self.alarms.append(event)
        reporter = min(set(range(self.world)) - set(suspects), default=0)
        if self.rank == reporter:
            if self.events is not None:
                Path(self.events).parent.mkdir(parents=True, exist_ok=True)  # else the alarm is lost in a crash
                with open(self.events, "a") as f:
                    f.write(json.dumps(asdict(event), sort_keys=True) + "\n")
            # Also without an events file: policy log (the default) must not skip steps silently.
            print(f"peat sdc: {event.message()}", file=sys.stderr, flush=True)
        if self.policy == "raise":
            raise SDCError(event)
        if self.policy == "stop":
            self._stop(event, reporter)

    def _stop(self, event: Event, reporter: int) -> None:
        doing, error = None, None
        try:
            if self._marker is not None and event.localized and self.hosts[self.rank] in event.hosts:
                # Read by the SLURM epilog on this node: it drains the node it runs on.
                doing = f"writing the drain marker {self._marker}"
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.write_text(json.dumps(asdict(event), sort_keys=True) + "\n")
            if self.save is not None and self.rank == reporter:
                doing = f"saving the checkpoint {self.checkpoint}"
                self.save(self.checkpoint)
        except Exception as err:  # the user's save may raise anything
            error = err
        # Instead of a barrier, each rank's failure, if any: a save that raised left the peers in the
        # barrier until the process group's timeout, then failing as if a rank had died.
        failures: list = [None] * self.world
        mine = None if error is None else (doing, f"{type(error).__name__}: {first_line(error)}")
        self._collective("stop", dist.all_gather_object, failures, mine, group=self.group)
        self._stop_failed(event.step, failures, error)
        code = exit_code(event)
        advice = (f"drain node(s) {', '.join(event.hosts)} and requeue" if event.localized else
                  f"no faulty node localized among {', '.join(event.hosts)}: a human must read the events; "
                  "do not requeue")
        print(f"peat sdc: stopping; {advice} (exit code {code})", file=sys.stderr, flush=True)
        raise SystemExit(code)

    def _stop_failed(self, step: int, failures: list, error: BaseException | None) -> None:
        """StopFailed on every rank if any rank's part of the stop failed (``failures``: each rank's
        (what it was doing, why it failed), or None)."""
        failed = [r for r, failure in enumerate(failures) if failure]
        if not failed:
            return
        where = f"rank {self.rank}: policy stop at step {step}"
        if error is not None:
            doing, why = failures[self.rank]
            raise StopFailed(f"{where}: {doing} failed ({why})", own=True) from error
        doing, why = failures[failed[0]]
        raise StopFailed(f"{where}: rank {failed[0]} on node {self.hosts[failed[0]]} failed {doing} ({why})",
                         own=False)

    # - collectives with clear failures -

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise  # this rank's own failure (a RuntimeError too), not a peer's
        except (RuntimeError, dist.DistError) as err:
            raise CollectiveFailed(collective_failure(self.rank, what, err)) from None

    def _start_gather(self, tensor: torch.Tensor, what: str):
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        return out, self._collective(what, dist.all_gather, out, tensor, group=self.group, async_op=True), what

    def _finish_gather(self, pending) -> list[torch.Tensor]:
        out, work, what = pending
        self._collective(what, work.wait)
        return out

    def _all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        return self._finish_gather(self._start_gather(tensor, what))

    def _timed(self, check: str, seconds: float, same_step: bool = False) -> None:
        if same_step:
            self.timers[check][-1] += seconds
        else:
            self.timers[check].append(seconds)
        self.spent += seconds

    def costs(self) -> dict:
        """Median seconds of each check per step where it ran (of its last ``TIMED_STEPS``)."""
        return {c: (float(torch.tensor(list(v)).median()) if v else None) for c, v in self.timers.items()}


def exit_code(event: Event) -> int:
    """Policy ``stop``'s exit code for ``event``: requeue only when a faulty rank was localized."""
    return EXIT_SDC if event.localized else EXIT_SDC_UNLOCALIZED


def collective_failure(rank: int, what: str, err: BaseException) -> str:
    return f"rank {rank}: collective '{what}' failed: a peer rank died or hung past the timeout ({first_line(err)})"


def first_line(err: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), or its type's name."""
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


NODE = "{node}"  # the drain marker's placeholder for this node's name


def _node_marker(drain_marker, node: str) -> Path:
    """The drain marker of node ``node``: ``drain_marker`` with NODE replaced by its name; PeatError
    saying why where it names no file on any node (a placeholder other than NODE)."""
    try:
        return Path(str(drain_marker).format(node=node))
    except (KeyError, IndexError, ValueError) as err:
        raise PeatError(f"the only placeholder is {NODE} ({type(err).__name__}: {err})") from None


def marker_problem(drain_marker) -> str | None:
    """Why ``drain_marker`` names no file on any node (a placeholder other than NODE), or None."""
    try:
        _node_marker(drain_marker, node_name())
    except PeatError as err:
        return str(err)
    return None


def _files_to_write(events, drain_marker, checkpoint, node: str) -> tuple[Path | None, str | None]:
    """This node's drain marker (None without one), resolved once for the guard, and why this rank could
    not write the events file, the drain marker or the stop checkpoint (their folders made now), or None.
    The guard writes them at an alarm only: there, one rank failed alone while its peers went on to the
    next collective (or waited in the stop's barrier) until the timeout."""
    try:
        marker = None if drain_marker is None else _node_marker(drain_marker, node)
    except PeatError as err:
        return None, f"drain_marker={str(drain_marker)!r}: {err}"
    return marker, _unwritable({"events": events, "checkpoint": checkpoint, "drain_marker": marker}, drain_marker)


def _unwritable(paths: dict, drain_marker) -> str | None:
    """Why this rank could not write one of ``paths`` (label -> path or None), or None."""
    for label, path in paths.items():
        if path is None:
            continue
        given, folder = str(drain_marker if label == "drain_marker" else path), Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return f"{label}={given!r}: cannot create its folder ({first_line(err)})"
        if not os.access(folder, os.W_OK):
            return f"{label}={given!r}: its folder {folder} is not writable"
        if Path(path).is_dir():
            return f"{label}={given!r}: is a folder; name the file"
    return None


def _mark_nonfinite(grad: torch.Tensor, bad):
    """Check one local gradient; a non-finite one gets NaN at its first element (a sparse one's first
    value). Returns the flag ``bad`` with this gradient's verdict in it (see ``Guard.begin_step``)."""
    if grad.is_sparse:
        grad = grad._values()  # a view: the mark reaches the gradient
    if not grad.numel():
        return bad
    if grad.device.type == "cpu":
        return _mark_nonfinite_host(grad, bad)
    return [*bad, _mark_nonfinite_on_device(grad)]


def _bucket_gradients(bucket, buffer: torch.Tensor) -> list:
    """``(param, local gradient)`` of a DDP bucket (``dist.GradBucket``); a complex one as its real view."""
    params = bucket.parameters()
    if not any(p.is_complex() for p in params):
        return list(zip(params, bucket.gradients()))
    # DDP lays a complex gradient out as its real view, two numbers each, but its views of the bucket
    # count one each: they held half of that gradient, and the next ones started too early.
    grads, start = [], 0
    for param in params:
        size = param.numel() * (2 if param.is_complex() else 1)
        grads.append((param, buffer[start:start + size]))
        start += size
    return grads


def _graph(loss: torch.Tensor) -> list:
    """The nodes of ``loss``'s autograd graph (each once)."""
    nodes, todo = {}, [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes[node] = None
            todo.extend(next_node for next_node, _ in node.next_functions)
    return list(nodes)


def _flagged(bad) -> bool:
    """Whether a step's flag (``_mark_nonfinite``) holds a non-finite gradient."""
    return bad if isinstance(bad, bool) else bool(bad) and not bool(torch.isfinite(torch.stack(bad)).all())


def _marks(grad: torch.Tensor) -> torch.Tensor:
    """The elements of an all-reduced gradient that hold a rank's mark: its first one, or every value
    of a sparse gradient (the reduction sums and reorders the ranks' rows)."""
    if grad.is_sparse:
        return grad._values().reshape(-1)
    grad = _real(grad)
    return grad[(0,) * grad.dim()].reshape(1) if grad.numel() else grad.reshape(0)


def _any_nonfinite(grads) -> bool:
    """Whether any element of ``grads`` (a sparse one's values) is NaN or Inf: one read of each, one host sync."""
    values = [g._values() if g.is_sparse else g for g in grads]
    if values[0].device.type == "cpu":
        return not all(_finite_host(v) for v in values)
    return _flagged([_device_total(v) for v in values])


def _finite_host(grad: torch.Tensor) -> bool:
    # A non-finite sum of finite values is an overflow: rechecked exactly.
    return cmath.isfinite(grad.sum().item()) or bool(torch.isfinite(grad).all())


def _mark_nonfinite_host(grad: torch.Tensor, bad: bool) -> bool:
    if _finite_host(grad):
        return bad
    grad[(0,) * grad.dim()].fill_(float("nan"))
    return True


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (a view), as DDP's buckets hold it: its
    float64 cast or sum keeps the real part only, and a fused report would not match."""
    return torch.view_as_real(t) if t.is_complex() else t


def _device_total(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's float64 sum, non-finite exactly when one of its values is, with no host sync:
    finite values of a narrower float cannot overflow it."""
    grad = _real(grad)
    if grad.dtype == torch.float64:  # a float64 sum may overflow: read the values instead
        return torch.where(torch.isfinite(grad).all(), 0.0, float("nan")).double()
    return grad.sum(dtype=torch.float64)


def _mark_nonfinite_on_device(grad: torch.Tensor) -> torch.Tensor:
    """``_device_total`` of the gradient, whose non-finite value marks it.

    Two kernel launches and no host sync inside backward: on a GPU a small model's step is bound by
    launches, and the seven this took per parameter cost more than the step itself (measured on an
    H200). The mark is first += -0.0 * total * total: -0.0 for a finite total, which leaves every
    value (-0.0 too) as it was, and NaN otherwise.
    """
    grad = _real(grad)
    total = _device_total(grad)
    grad[(0,) * grad.dim()].addcmul_(total, total, value=-0.0)
    return total


def _buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in module.buffers()]


def _set_buffers(module: torch.nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, value in zip(module.buffers(), values):
            b.copy_(value)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The random state a forward on ``device`` draws from (CPU, plus the device's own), as int64
    words so that it can travel in one gather with the audit fingerprints."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts).view(torch.int64)


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    state = state.cpu().view(torch.uint8)
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[cpu:].clone(), device)
