"""Deterministic training: golden runs, candidate-kernel runs and resumed runs share this loop.

Same config, same machine -> bit-identical weights, metrics (but their ``wall_time`` column)
and recorded context: seeds are fixed, deterministic algorithms are enforced, the thread count
is fixed, and the batch order and random draws (dropout) of epoch ``e`` depend only on
``(seed, e)``, so a run resumed from a checkpoint replays exactly the batches and draws an
uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from . import checkpoint
from .data import Dataset
from .io import PeatError, atomic_path, open_h5, write_csv
from .models import loss_and_metrics
from .profiler import check_records_a_step


@dataclass
class Run:
    """Everything the loop needs besides the model and the data."""

    epochs: int
    batch_size: int
    optimizer: dict
    seed: int = 0
    checkpoint_epochs: list[int] = field(default_factory=list)
    max_train_samples: int | None = None
    max_val_samples: int | None = None
    device: torch.device = torch.device("cpu")
    meta: dict = field(default_factory=dict)  # stamped on every checkpoint

    @classmethod
    def from_spec(cls, spec: dict, **extra) -> "Run":
        keys = ("epochs", "batch_size", "optimizer", "checkpoint_epochs", "max_train_samples", "max_val_samples")
        return cls(**{k: spec[k] for k in keys if k in spec}, **extra)


def make_optimizer(model: torch.nn.Module, spec: dict) -> torch.optim.Optimizer:
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    if spec["name"] == "sgd":
        return torch.optim.SGD(model.parameters(), **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of torch's generators for epoch ``epoch`` (independent of its batch order's stream)."""
    return int(np.random.SeedSequence([seed, epoch, 1]).generate_state(1, np.uint64)[0])


def fit(model: torch.nn.Module, data: Dataset, run: Run, out_dir: str | Path, *,
        profiler=None, before_step: Callable[[int, int], None] | None = None,
        start: str | Path | None = None, progress: bool = True, resumable: bool = True,
        on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Train ``model``; write ``metrics.csv``, ``final.h5`` and ``checkpoints/epochNNN.h5``.

    ``on_row`` gets each new row of the curve (a step's loss, a validation point) as it is made.

    ``start`` is a checkpoint to resume from (weights, optimizer, step, epoch, history).
    While running, everything lives in ``out_dir/.partial/``: epoch checkpoints and
    ``resume.h5`` (the last finished epoch, unless not ``resumable``), so that a killed job
    restarts from there. The declared outputs appear only when training completes, so none of
    them is ever half written.
    """
    out_dir = Path(out_dir)
    train_x, train_y = _subset(data.train, run.max_train_samples)
    val_x, val_y = _subset(data.val, run.max_val_samples)
    # Only a resumable run leaves a resume point to vouch for (candidate runs hash nothing).
    inputs = _inputs_digest(model, (train_x, train_y, val_x, val_y), start, _settings(run, profiler)) if resumable else ""
    model.to(run.device)
    optimizer = make_optimizer(model, run.optimizer)
    partial = out_dir / ".partial"
    resume = partial / "resume.h5"
    start = _resume_point(resume, run.meta, inputs) or start
    step, first_epoch, history = 0, 1, []
    if start is not None:
        state = checkpoint.load(start, model, optimizer)
        step, first_epoch, history = int(state["step"]), int(state["epoch"]) + 1, state["history"]
        print(f"resuming from {start} at step {step}, epoch {first_epoch}", flush=True)
    t0 = time.perf_counter() - (history[-1]["wall_time"] if history else 0.0)
    batches_per_epoch = len(epoch_batches(len(train_x), run.batch_size, run.seed, 0))
    if batches_per_epoch == 0:  # the last partial batch is dropped: nothing would train
        raise PeatError(f"config key '{_key(run, 'batch_size')}': {run.batch_size} is more than the {len(train_x)} "
                        "training samples; no training step would run")
    if profiler is not None:
        check_records_a_step(_key(run, "record.every"), profiler.every, profiler.epochs, batches_per_epoch)
        # Last before the loop: from here on, an interruption closes its file (abandon).
        profiler.attach(model, first_step=step, resuming=start == resume)
    bar = tqdm(total=run.epochs * batches_per_epoch, initial=step, disable=not progress, mininterval=2, desc="train")

    def record(row: dict) -> None:
        history.append(row)
        if on_row is not None:
            on_row(row)

    try:
        for epoch in range(first_epoch, run.epochs + 1):
            model.train()
            # Dropout masks too depend only on (seed, epoch): a resumed run draws what an uninterrupted
            # one draws (the generator's state is not in the checkpoint).
            torch.manual_seed(epoch_seed(run.seed, epoch))
            for idx in epoch_batches(len(train_x), run.batch_size, run.seed, epoch):
                if before_step is not None:
                    before_step(step, epoch)
                if profiler is not None:
                    profiler.begin_step(step, epoch)
                optimizer.zero_grad(set_to_none=True)
                x, y = train_x[idx].to(run.device), train_y[idx].to(run.device)
                loss, counts = train_forward(model, data.kind, x, y, _key(run, "batch_size"))
                loss.backward()
                if profiler is not None:
                    profiler.end_step()
                optimizer.step()
                record(_row(step, epoch, "train", loss.item(), counts, data.kind, t0))
                step += 1
                bar.update()
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}", refresh=False)
            record(_evaluate(model, data.kind, val_x, val_y, run, step, epoch, t0))
            save = dict(step=step, epoch=epoch, meta=run.meta, history=history)
            if epoch in run.checkpoint_epochs:
                checkpoint.save(partial / f"epoch{epoch:03d}.h5", model, optimizer, **save)
            if epoch < run.epochs and resumable:
                # Context snapshot first: if we die between the two, the older resume point
                # drops the newer snapshot.
                if profiler is not None:
                    profiler.snapshot()
                with atomic_path(partial / INPUTS) as tmp:  # before the resume point it vouches for
                    tmp.write_text(inputs)
                checkpoint.save(resume, model, optimizer, **save)
        bar.close()
        # Guarded too: a failure here (a full disk, Ctrl-C) must close the Profiler's file, or a rerun in
        # this process cannot create it anew.
        checkpoint.save(out_dir / "final.h5", model, optimizer, step=step, epoch=run.epochs, meta=run.meta,
                        history=history)
        if profiler is not None:
            profiler.close()
    except BaseException:
        bar.close()  # now, not at exit: its last refresh came after the error, no longer last in the log
        if profiler is not None:
            profiler.abandon()
        raise
    metrics = pd.DataFrame(history)
    _publish_checkpoints(partial, out_dir / "checkpoints")
    write_csv(out_dir / "metrics.csv", metrics)
    shutil.rmtree(partial, ignore_errors=True)
    return metrics


# Beside the resume point: the digest of the inputs of the run that left it.
INPUTS = "inputs.sha256"


def _settings(run: Run, profiler) -> str:
    """The settings a run trains and records with (its meta aside, compared on its own): the workflow's
    config hash covers them, but a library caller's meta need not (train_model's config_hash is ""
    by default), and a run killed under another lr, batch size, recorded layers or thread count was resumed."""
    settings = {f.name: getattr(run, f.name) for f in fields(run) if f.name != "meta"}
    settings["threads"] = torch.get_num_threads()  # a CPU sum split over more threads rounds otherwise
    if profiler is not None:
        settings["record"] = [profiler.patterns, profiler.every, profiler.epochs, profiler.derived]
    return json.dumps(settings, sort_keys=True, default=str)


def _inputs_digest(model: torch.nn.Module, tensors, start, settings: str = "") -> str:
    """What a run starts from: the data it trains and validates on, the model's initial state
    (init_from's base weights), ``start``'s bytes and its ``settings``. The config hash names none of
    the first three: a dataset prepared again from edited files, or a base model trained again, keeps it."""
    digest = hashlib.sha256(settings.encode())
    for t in (*tensors, *model.state_dict().values()):
        if isinstance(t, torch.Tensor):  # bytes of any dtype (numpy has no bfloat16)
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    if start is not None:
        with open(start, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def stop_if_diverged(name: str) -> Callable[[dict], None]:
    """``on_row`` of golden training: a loss gone NaN or inf stops it. Golden is the reference every
    kernel is judged against, and past a NaN every kernel's output matches golden's (a NaN
    reproduced is no error)."""
    def check(row: dict) -> None:
        if not math.isfinite(row["loss"]):
            raise PeatError(f"config key 'models.{name}.optimizer': golden training diverged ({row['split']} loss "
                            f"{row['loss']} at step {row['step']}, epoch {row['epoch']}); past a NaN every kernel's "
                            "output matches golden's, so it is no reference: lower the lr, or raise batch_size")
    return check


def _resume_point(resume: Path, meta: dict, inputs: str) -> Path | None:
    """``resume`` when a killed run of these settings (``meta``) and ``inputs`` left it; its folder is
    discarded when a run of other settings (an edited config) or inputs did: resuming would mix the two.
    A folder without a resume point (killed in its first epoch's saves, or in its last epoch's when that
    was its first; any candidate run) is discarded too: its epoch checkpoints, of whatever settings it
    ran, were published with this run's."""
    if not resume.exists():
        if resume.parent.exists():
            print(f"discarding {resume.parent}: left by a run that saved no resume point", flush=True)
            shutil.rmtree(resume.parent)
        return None
    with open_h5(resume) as f:
        same = all(k in f.attrs and f.attrs[k] == v for k, v in meta.items())
    marker = resume.with_name(INPUTS)
    if same and marker.exists() and marker.read_text() == inputs:
        return resume
    print(f"discarding {resume.parent}: left by a run with other settings or inputs", flush=True)
    shutil.rmtree(resume.parent)
    return None


def _publish_checkpoints(partial: Path, dest_dir: Path) -> None:
    """The epoch checkpoints of ``partial`` in ``dest_dir``, linked, not moved: a job killed before
    ``partial`` is gone has its outputs deleted by Snakemake, and its rerun trains only the epochs
    after the resume point."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    for saved in sorted(partial.glob("epoch*.h5")):
        dest = dest_dir / saved.name
        dest.unlink(missing_ok=True)
        try:
            os.link(saved, dest)
        except OSError:  # a file system without hard links
            shutil.copy2(saved, dest)


def _subset(split, limit):
    return (split.x, split.y) if limit is None else (split.x[:limit], split.y[:limit])


def _row(step, epoch, split, loss, counts, kind, t0) -> dict:
    return {
        "step": step, "epoch": epoch, "split": split, "loss": loss,
        "accuracy": counts["correct"] / counts["count"],
        "perplexity": _perplexity(loss) if kind == "text" else float("nan"),
        "wall_time": time.perf_counter() - t0,
    }


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:  # a loss above ~709: beyond float64, as a diverged run's is
        return math.inf


def _key(run: Run, key: str) -> str:
    """The config key of a model setting, as errors name it."""
    return f"models.{run.meta['model']}.{key}" if "model" in run.meta else key


class BatchTooSmall(PeatError):
    """A training batch too small for batch norm: a config error found at the first step."""


def train_forward(model: torch.nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor, key: str):
    """``loss_and_metrics`` of one training batch; ``key`` is the config key that sets its size.
    Whether a batch is too small for batch norm depends on the feature maps the batch reaches,
    so it shows only here, at the first step."""
    try:
        return loss_and_metrics(model, kind, x, y)
    except ValueError as err:
        if "more than 1 value per channel" not in str(err):
            raise
        raise BatchTooSmall(f"config key '{key}': batches of {len(x)} leave a batch norm layer one value per channel "
                            f"in training ({err}); use a larger batch") from err


@torch.no_grad()
def _evaluate(model, kind, x, y, run: Run, step: int, epoch: int, t0: float) -> dict:
    model.eval()
    total, correct, count = 0.0, 0, 0
    for i in range(0, len(x), run.batch_size):
        xb, yb = x[i:i + run.batch_size].to(run.device), y[i:i + run.batch_size].to(run.device)
        loss, counts = loss_and_metrics(model, kind, xb, yb)
        total += loss.item() * counts["count"]
        correct += counts["correct"]
        count += counts["count"]
    return _row(step, epoch, "val", total / count, {"correct": correct, "count": count}, kind, t0)


def train_model(name: str, spec: dict, data_path: str | Path, out_dir: str | Path, *, vendor: str = "cpu",
                seed: int = 0, threads: int = 1, init: str | Path | None = None, config_hash: str = "",
                prepare_model: Callable[[torch.nn.Module], None] | None = None,
                before_step: Callable[[int, int], None] | None = None, record: bool = True,
                progress: bool = True, start: str | Path | None = None, resumable: bool = True,
                on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Golden (or candidate) training of model ``name`` from its config ``spec``, with the Profiler.

    ``init`` fine-tunes from another run's checkpoint (a new head keeps its own init);
    ``prepare_model`` may patch the built model (candidate kernels) before training starts.
    ``start`` resumes from a checkpoint (e.g. an altered one) to the end of the schedule;
    ``resumable`` False skips the per-epoch resume point (for runs that always start afresh);
    ``on_row`` gets each row of the curve as it is made (see ``fit``).
    """
    from .data import load
    from .device import for_vendor, seed_everything
    from .models import build
    from .profiler import Profiler

    device = for_vendor(vendor)
    seed_everything(seed, threads)
    data = load(data_path)
    model = build(spec, data.attrs, seed)
    if init is not None:
        checkpoint.load(init, model, new_head=True)
    if prepare_model is not None:
        prepare_model(model)
    meta = {"model": name, "arch": spec["arch"], "dataset": spec["dataset"], "vendor": vendor,
            "config_hash": config_hash, "torch_version": str(torch.__version__), "seed": seed}
    out_dir = Path(out_dir)
    profiler = None
    if record:
        rec = spec["record"]
        # A GPU's golden differs from the CPU's in rounding and a reader may have no such GPU:
        # contexts recorded there keep the golden outputs (docs/design.md, "Context file").
        profiler = Profiler(out_dir / "context.h5", rec["layers"], every=rec.get("every", 10),
                            epochs=rec.get("epochs"), meta=meta, key=f"models.{name}.record.layers",
                            derived=bool(rec.get("derived", False)) or vendor != "cpu")
    run = Run.from_spec(spec, seed=seed, device=device, meta=meta)
    return fit(model, data, run, out_dir, profiler=profiler, before_step=before_step, progress=progress, start=start,
               resumable=resumable, on_row=on_row)


def evaluate_checkpoint(name: str, spec: dict, data_path: str | Path, path: str | Path, *, vendor: str = "cpu",
                        seed: int = 0, threads: int = 1) -> dict:
    """Validation loss and accuracy of the weights in checkpoint ``path``, without training.

    The alteration study measures the damage right after the flips with this, before resuming.
    """
    from .data import load
    from .device import for_vendor, seed_everything
    from .models import build

    device = for_vendor(vendor)
    seed_everything(seed, threads)
    data = load(data_path)
    model = build(spec, data.attrs, seed)
    state = checkpoint.load(path, model)
    run = Run.from_spec(spec, seed=seed, device=device)
    val_x, val_y = _subset(data.val, run.max_val_samples)
    row = _evaluate(model.to(device), data.kind, val_x, val_y, run, int(state["step"]), int(state["epoch"]), 0.0)
    return {"accuracy": row["accuracy"], "loss": row["loss"]}
