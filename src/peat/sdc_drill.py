"""SDC drills: real multi-process DDP training with one injected fault, checked by ``peat.sdc``.

Worker entry point, the same under torchrun and srun::

    torchrun --standalone --nproc-per-node 3 -m peat.sdc_drill --config CFG --model M --data D.h5 --out DIR
    srun --ntasks 3 python -m peat.sdc_drill --config CFG --model M --data D.h5 --out DIR

All drills of one model run in one launch (one process group, a fresh model per drill): process
start-up dominates these small runs. A drill that ends every rank (policy stop, ``dead``, ``hang``)
ends the launch; ``launch`` checks that end, records it (every rank's exit code) in that drill's
``DIR/{drill}.json`` and starts the drills after it anew. Otherwise rank 0 writes
``DIR/{drill}.json``; alarms go to ``DIR/events/{drill}.jsonl``. ``--bench`` instead times plain DDP
steps against guarded ones.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint, errors, sdc
from .io import PeatError, not_utf8, write_json
from .provenance import stamp

DRILLS = ("clean", "nan_grad", "lane_fault", "weight_flip", "transient")
RELIABILITY = ("dead", "hang")  # a rank exits / stalls mid-drill: the drill must fail clearly
EXIT_USAGE = 2  # a bad config, data file or command line (as argparse): found before joining the process group,
# or, for a batch too small for batch norm, at the first step
EXIT_PEER = 3  # a collective failed: a peer died or hung, or failed its part of a policy stop (its save)
EXIT_OWN = 1  # this rank's own failure other than those below, as an uncaught exception's (its stop's save raised)
EXIT_OOM = 4  # this rank ran out of (GPU) memory; its peers then exit EXIT_PEER
EXIT_DEAD = 13  # the dead drill's injected rank
PEER_FAILED = "a peer rank died or hung past the timeout"  # in sdc.collective_failure's message
ERROR = "peat sdc drill: error: "  # how a rank's own one-line error starts


# --- launching ----------------------------------------------------------------------------------

def launch(config: dict, model: str, data: str | Path, out_dir: str | Path, *, bench: bool = False,
           timeout: float | None = None) -> None:
    """Run the drills (or the benchmark) of ``model``: ``sdc.world_size`` local ranks, one process each.

    A drill whose documented end is the end of every rank (policy stop; ``dead``, ``hang``) ends its
    launch: that end is checked from every rank's exit status and output and recorded in the drill's
    JSON, and the drills after it run in a new launch. Any other end raises PeatError (one line).
    ``config`` is a workflow config, raw or validated.
    """
    config = validated(config)  # a raw YAML dict lacks the defaults read here and by the ranks
    sdc_cfg = config["sdc"]
    out_dir = output_folder(out_dir)
    plan = out_dir / (".bench.json" if bench else ".plan.json")
    write_json(plan, config)
    args = ["--config", str(plan), "--model", model, "--data", str(data), "--out", str(out_dir)]
    ranks = Launch(config, f"sdc drill of model {model!r}", time.monotonic() + (timeout or launch_timeout(sdc_cfg, bench)))
    try:
        if bench:
            ends = ranks.run([*args, "--bench"])
            _check_started(f"sdc benchmark of model {model!r}", ends)
            codes = [end.code for end in ends]
            if any(code != 0 for code in codes):  # None: a rank killed as hung
                raise PeatError(f"sdc benchmark of model {model!r}: rank exit codes {codes}{_killed(codes)} "
                                "(see the log above)")
            return
        remaining = list(sdc_cfg["drills"])
        while remaining:
            for drill in remaining:  # an earlier run's record or stop checkpoint would pass for this run's
                (out_dir / f"{drill}.json").unlink(missing_ok=True)
                (out_dir / f"{drill}.stop.h5").unlink(missing_ok=True)
            ends = ranks.run([*args, "--drills", ",".join(remaining)])
            _check_started(f"sdc drill of model {model!r}", ends)
            current = next((d for d in remaining if _outcome(out_dir / f"{d}.json") != "completed"), None)
            if current is None and all(end.code == 0 for end in ends):  # None: a rank killed as hung
                return
            if current is None:
                codes = [end.code for end in ends]
                raise PeatError(f"sdc drill of model {model!r}: every drill completed but the rank exit codes are "
                                f"{codes}{_killed(codes)} (see the log above)")
            write_json(out_dir / f"{current}.json",
                       drill_end(current, model, sdc_cfg, ends, out_dir, seed=config["seed"]))
            remaining = remaining[remaining.index(current) + 1:]
    finally:
        plan.unlink(missing_ok=True)


def output_folder(path: str | Path) -> Path:
    """``path``, made a folder if it is none yet; one line naming it where it cannot be."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PeatError(f"{path}: cannot make the output folder ({sdc.first_line(err)})") from None
    return path


def _check_started(what: str, ends: list[RankEnd]) -> None:
    """PeatError with the ranks' own error if ranks refused to start (exit 2: a config, data or
    command-line error, or a share of the batch too small for batch norm at the first step) and the
    others, if any, failed only as their peers (exit 3: uneven shares leave some ranks one example).
    Read as the end of the first drill, it showed only the exit codes."""
    refused = {rank: end for rank, end in enumerate(ends) if end.code == EXIT_USAGE}
    if not refused or any(end.code not in (EXIT_USAGE, EXIT_PEER) for end in ends):
        return
    errors = {rank: _last_line(end.output).removeprefix(ERROR) for rank, end in refused.items()}
    if len(set(errors.values())) == 1:
        raise PeatError(f"{what}: {next(iter(errors.values()))}")
    raise PeatError(f"{what}: " + "; ".join(f"rank {rank}: {error}" for rank, error in errors.items()))


def _killed(codes: list[int | None]) -> str:
    """' (rank R killed by SIGKILL, ...)' for the ranks a signal ended (Popen's negative code), else ''.
    A -9 alone left the user to know Popen's convention; SIGKILL is also what the kernel's OOM killer sends."""
    killed = [f"rank {rank} killed by {_signal_name(-code)}" for rank, code in enumerate(codes)
              if code is not None and code < 0]
    return f" ({', '.join(killed)})" if killed else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else "no output"


def _outcome(path: Path) -> str | None:
    return json.loads(path.read_text())["outcome"] if path.exists() else None


@dataclass
class RankEnd:
    """How one rank ended: its exit status (None: still running once every peer had ended and
    ``timeout_s`` had passed, so hung, and killed by the launcher) and its output."""

    code: int | None
    output: str


class Launch:
    """Starts the ranks of one launch, as torchrun does (RANK, WORLD_SIZE, ... and a rendezvous store
    held here), but waits for every rank's own end: torchrun stops all ranks as soon as one fails,
    before the peers of a dead rank can report it, and exits 1 for every failure."""

    def __init__(self, config: dict, what: str, deadline: float):
        self.world, self.timeout_s = config["sdc"]["world_size"], config["sdc"]["timeout_s"]
        self.threads, self.what, self.deadline = config.get("threads", 1), what, deadline
        self.terminated = 0  # the signal that terminates the launcher, once one came

    def run(self, args: list[str]) -> list[RankEnd]:
        """Run ``python -m peat.sdc_drill *args`` on every rank; their output goes to stdout as it comes, prefixed."""
        # torchrun's own rendezvous: every rank a client of this store, so no free port to guess and race for.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # Unbuffered: a rank's lines reach the log as it writes them, not when it ends.
        env = {**os.environ, "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        arm = _death_signal()  # run between fork and exec: the output threads start after every rank
        # torchrun ends its workers when it is terminated: without that, a plain kill of the launcher left
        # every rank running, a hung one for days. Set before the first rank starts (a kill as they
        # started ended the launcher untidily); a handler can only be set in the main thread.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._terminated) if main else None
        procs, tees = [], []
        try:
            for r in range(self.world):
                self._stop_if_terminated()
                procs.append(subprocess.Popen([sys.executable, "-m", "peat.sdc_drill", *args], stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, preexec_fn=arm,
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
            tees = [Tee(f"[rank{rank}]: ", proc.stdout) for rank, proc in enumerate(procs)]
            hung = self._wait(procs)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
            for proc in procs:
                if proc.poll() is None:  # hung, the time limit, or an interrupt
                    proc.kill()
                    proc.wait()
            outputs = [tee.output() for tee in tees]
        return [RankEnd(None if h else proc.returncode, text) for proc, h, text in zip(procs, hung, outputs)]

    def _terminated(self, signum, frame):
        # Only noted, and raised where run and _wait look: raised here, its SystemExit could land in
        # Popen.poll between taking its waitpid lock and the try that releases it, and killing the
        # ranks then waited on that lock for good (the launcher hung, a rank with it).
        self.terminated = signum

    def _stop_if_terminated(self) -> None:
        if self.terminated:  # the shell's code for a process the signal ended
            raise SystemExit(128 + self.terminated)

    def _wait(self, procs: list) -> list[bool]:
        """Wait for the ranks; returns which are hung (to be killed)."""
        # Once a rank has ended, a healthy peer finds out within its collective timeout: a rank still
        # running after that is hung.
        give_up = self.deadline
        while any(proc.poll() is None for proc in procs):
            self._stop_if_terminated()
            now = time.monotonic()
            if now >= self.deadline:
                raise PeatError(f"{self.what}: the ranks did not finish within the launcher's time limit")
            if now >= give_up:
                break
            if any(proc.poll() is not None for proc in procs):
                give_up = min(give_up, now + self.timeout_s + 10)  # 10 s to report the dead peer and exit
            time.sleep(0.1)
        self._stop_if_terminated()  # as the last rank ended
        return [proc.poll() is None for proc in procs]


def _death_signal():
    """Popen's ``preexec_fn`` that makes the rank die with this thread (Linux PR_SET_PDEATHSIG), even
    when the launcher is SIGKILLed and cannot end its ranks itself; None where prctl is missing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError, TypeError):  # not Linux
        return None
    launcher, kill, pr_set_pdeathsig = os.getpid(), int(signal.SIGKILL), 1

    def arm() -> None:  # in the child, between fork and exec
        prctl(pr_set_pdeathsig, kill)
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(128 + kill)

    return arm


class Tee(threading.Thread):
    """Copies one rank's output to stdout line by line as it comes, prefixed as torchrun's ``--tee``
    does, and keeps it for the end-of-launch checks. It blocks in read(): no polling."""

    _stdout = threading.Lock()  # one line at a time from all ranks

    def __init__(self, prefix: str, pipe):
        super().__init__(daemon=True)  # a rank's child holding the pipe open must not keep the launcher
        self.prefix, self.pipe, self.lines = prefix, pipe, []
        self.start()

    def run(self) -> None:
        with self.pipe:
            for raw in self.pipe:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                with Tee._stdout:
                    sys.stdout.write(self.prefix + line.rstrip("\n") + "\n")
                    sys.stdout.flush()

    def output(self, timeout: float = 10) -> str:
        """Everything the rank wrote, once it has ended (its pipe closed)."""
        self.join(timeout)
        return "".join(self.lines)


def drill_end(drill: str, model: str, cfg: dict, ends: list[RankEnd], out_dir: Path, *, seed: int) -> dict:
    """The record of a drill that ended its launch, if it ended the documented way; else PeatError.

    Policy stop: every rank exits with the code rank 0 recorded (75 localized, 65 not) and the stop
    checkpoint exists. ``dead``/``hang``: the injected rank exits 13 / hangs, and every other rank
    fails its collective with the peer message and exit code 3.
    """
    codes = [end.code for end in ends]
    path = out_dir / f"{drill}.json"
    if cfg["policy"] == "stop" and _outcome(path) == "stopped":
        result = json.loads(path.read_text())
        if codes == [result["exit_code"]] * len(codes) and (out_dir / f"{drill}.stop.h5").exists():
            return result | {"exit_codes": codes, "checkpoint": f"{drill}.stop.h5"}
        expected = f"every rank {result['exit_code']} and {drill}.stop.h5"
    elif drill in RELIABILITY:
        injected = cfg["injected_rank"]
        own = EXIT_DEAD if drill == "dead" else None
        peers = [end for rank, end in enumerate(ends) if rank != injected]
        if codes[injected] == own and all(end.code == EXIT_PEER and PEER_FAILED in end.output for end in peers):
            errors = [next(ln for ln in end.output.splitlines() if PEER_FAILED in ln) for end in peers]
            # The launcher's ranks are local: this node's, with the backend they resolved as it does.
            backend = "nccl" if _uses_cuda(cfg["backend"], len(ends)) else "gloo"
            return drill_fields(drill, model, len(ends), injected, cfg) | {
                "outcome": "peers_failed", "detected": True, "exit_codes": codes, "peer_errors": errors,
            } | origin(backend, [sdc.node_name()] * len(ends), seed)
        expected = (f"rank {injected} {'exits 13' if own else 'hangs'}, every other rank {EXIT_PEER} "
                    f"('{PEER_FAILED}')")
    else:
        expected = "every rank 0" + (f", or every rank {sdc.EXIT_SDC} or {sdc.EXIT_SDC_UNLOCALIZED} and "
                                     f"{drill}.stop.h5" if cfg["policy"] == "stop" else "")
    raise PeatError(f"sdc drill {drill!r} of model {model!r}: unexpected end: rank exit codes {codes}{_killed(codes)}, expected "
                    f"{expected} (see the log above)")


def drill_config(config: dict, model: str) -> dict:
    """The part of a validated config that ``model``'s drills depend on (Snakemake params: editing
    another section does not rerun the drills). Drills train from scratch: ``init_from`` is dropped.
    The config's ``name`` only names its report: a fixed one, so a renamed copy of a config does not
    rerun the drills. Drills run ``sdc.steps`` steps on the whole training set and record nothing,
    so the keys that only shape golden training are left at fixed values the schema accepts; so are
    ``vendors`` and ``reference_vendor``, which no drill reads (its device follows ``sdc.backend``).
    Of the sdc section, ``bench_steps`` (read by --bench only) and the faults of drills not run are
    left out: editing them reran every drill.
    """
    golden_only = ("init_from", "epochs", "checkpoint_epochs", "record", "max_train_samples", "max_val_samples")
    spec = {k: v for k, v in config["models"][model].items() if k not in golden_only}
    spec |= {"epochs": 1, "record": {"layers": ["*"]}}
    keep = ("seed", "threads")
    sdc_cfg = {k: v for k, v in config["sdc"].items() if k != "bench_steps"}
    sdc_cfg |= {"models": [model], "faults": {d: f for d, f in sdc_cfg["faults"].items() if d in sdc_cfg["drills"]}}
    return {"name": "sdc", **{k: config[k] for k in keep if k in config}, "vendors": ["cpu"],
            "reference_vendor": "cpu", "models": {model: spec},
            "datasets": {spec["dataset"]: config["datasets"][spec["dataset"]]}, "sdc": sdc_cfg}


def launch_timeout(sdc_cfg: dict, bench: bool = False) -> float:
    """Seconds a launch may take before the launcher stops its ranks: generous, as every collective
    already times out after timeout_s; this only guards the launcher. Each dead/hang drill and each
    stop starts a launch of its own. It allows each step timeout_s: a limit fixed whatever
    sdc.steps said stopped long healthy drills of a large model. --bench runs no drill: a plain and
    a guarded step per bench step, once."""
    if bench:
        return 600 + (4 + 2 * sdc_cfg["bench_steps"]) * sdc_cfg["timeout_s"]
    return 600 + (4 + sdc_cfg["steps"]) * sdc_cfg["timeout_s"] * len(sdc_cfg["drills"])


# --- the worker ---------------------------------------------------------------------------------

def init_distributed(backend: str, timeout_s: float, world_size: int | None = None) -> tuple[int, int, torch.device]:
    """Join the process group from torchrun's or SLURM's environment; every collective times out.
    ``world_size`` (sdc.world_size) must be the number of ranks launched."""
    env = os.environ
    launched_by = "WORLD_SIZE"
    if "RANK" not in env and "SLURM_PROCID" in env:
        if "MASTER_ADDR" not in env:
            raise PeatError("MASTER_ADDR is not set under srun: export "
                            "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)")
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
                   LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_PORT", "29500")
        launched_by = "SLURM_NTASKS"
    if "RANK" not in env:
        raise PeatError("not launched by torchrun or srun (RANK and SLURM_PROCID are unset)")
    # The config's injected rank, batch bounds and record are for sdc.world_size ranks: with fewer, an
    # injected rank past the last one injected nothing and the drill recorded "not detected".
    if world_size is not None and env.get("WORLD_SIZE") != str(world_size):
        raise PeatError(f"config key 'sdc.world_size': {world_size}, but {env.get('WORLD_SIZE')} rank(s) were "
                        f"launched ({launched_by}): launch sdc.world_size ranks, or set it to the number launched")
    use_cuda = _uses_cuda(backend, int(env.get("LOCAL_WORLD_SIZE") or _slurm_local_tasks(env)))
    device = torch.device("cuda", int(env.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda and device.index >= torch.cuda.device_count():  # else CUDA's own traceback from every rank
        raise PeatError(f"config key 'sdc.backend': {backend} needs one GPU per rank of a node; local rank "
                        f"{device.index} sees {torch.cuda.device_count()} GPU(s)")
    if use_cuda:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    except ValueError as err:  # torch's env:// reading: a variable unset or not a number
        raise PeatError(f"cannot join the process group: {sdc.first_line(err)}") from None
    except (RuntimeError, dist.DistError) as err:
        # A peer that refused to start (exit 2) never joins: the others waited here and died with torch's
        # traceback (exit 1), which the launcher could not tell from a crash, and its line went unreported.
        raise JoinFailed(f"rank {env['RANK']}: joining the process group at {env.get('MASTER_ADDR')}:"
                         f"{env.get('MASTER_PORT')} failed: a peer rank did not join within sdc.timeout_s, or the "
                         f"address cannot be reached ({sdc.first_line(err)})") from None
    return dist.get_rank(), dist.get_world_size(), device


class JoinFailed(PeatError):
    """The process group could not be joined: a peer's failure (exit EXIT_PEER), not this rank's config."""


def _uses_cuda(backend: str, local_ranks: int) -> bool:
    # auto takes nccl only where every local rank has a GPU of its own: NCCL refuses two ranks on one
    # GPU, so 3 drill ranks on a one-GPU workstation run on gloo rather than fail. Every rank of a
    # node decides alike, as it must: a process group cannot mix backends.
    return backend == "nccl" or (backend == "auto" and torch.cuda.device_count() >= local_ranks)


def _slurm_local_tasks(env) -> int:
    # SLURM_NTASKS_PER_NODE reads "3" or, on uneven nodes, "3(x2),2": the most, the same on every node.
    return max(int(n) for n in re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_NTASKS_PER_NODE", "1")))


def _help_text() -> tuple[str, str]:
    """--help's description and epilog: the docstring's summary and launch commands, without reST's `` and ::."""
    summary, usage, launch = __doc__.split("\n\n")[:3]
    return summary.replace("``", ""), usage.replace("::", ":") + "\n" + launch


def main(argv: list[str] | None = None) -> int:
    description, epilog = _help_text()
    parser = argparse.ArgumentParser(prog="python -m peat.sdc_drill", description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="workflow config (YAML or JSON)")
    parser.add_argument("--model", required=True, help="model name in the config")
    parser.add_argument("--data", required=True, help="prepared dataset (results/data/<dataset>.h5)")
    parser.add_argument("--out", required=True, help="output folder (results/sdc/<model>)")
    parser.add_argument("--drills", help="comma-separated drills to run (default: the config's sdc.drills)")
    parser.add_argument("--bench", action="store_true", help="time plain vs guarded DDP steps instead")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.model not in config["models"]:
            raise PeatError(f"{args.config}: no model {args.model!r}; defined: {', '.join(config['models'])}")
        spec, sdc_cfg = config["models"][args.model], config["sdc"]
        drills = args.drills.split(",") if args.drills else sdc_cfg["drills"]
        unknown = [d for d in drills if d not in DRILLS + RELIABILITY]
        if unknown:  # else only the injected rank finds out, mid-launch, and its peers see it die
            raise PeatError(f"--drills: unknown drill {unknown[0]!r}; allowed: {', '.join(DRILLS + RELIABILITY)}")
        from .data import load

        output_folder(args.out)  # else rank 0 failed alone making events/ in the first drill, its peers waiting
        data = load(args.data)  # a missing or wrong file: one line, not a traceback from every rank
        prepared = data.attrs.get("name")  # the dataset's config key, where the file was prepared by peat
        if prepared is not None and prepared != spec["dataset"]:  # else a KeyError from every rank building the model
            raise PeatError(f"{args.data}: dataset {prepared!r}, but model {args.model!r} trains on dataset "
                            f"{spec['dataset']!r} (models.{args.model}.dataset)")
        _check_prepared(args.data, data, spec["dataset"], config["datasets"][spec["dataset"]], args.config)
        # The drills' settings are for sdc.world_size ranks; --bench times any number (.ci/gpu: one rank per GPU).
        world_size = None if args.bench else sdc_cfg["world_size"]
        rank, world, device = init_distributed(sdc_cfg["backend"], sdc_cfg["timeout_s"], world_size)
    except JoinFailed as err:
        print(f"{ERROR}{err}", file=sys.stderr)
        return EXIT_PEER
    except PeatError as err:
        print(f"{ERROR}{err}", file=sys.stderr)
        return EXIT_USAGE
    from .device import seed_everything
    from .train import BatchTooSmall

    seed_everything(config["seed"], config["threads"])
    task = "the benchmark"
    try:
        if args.bench:
            result = benchmark(spec, data, sdc_cfg, config["seed"], device)
            if rank == 0:
                write_json(Path(args.out) / "bench.json", {"model": args.model, "world_size": world, **result})
        for drill in [] if args.bench else drills:
            task = f"drill {drill!r}"
            result = run_drill(drill, args.model, spec, data, sdc_cfg, config["seed"], device, Path(args.out))
            if rank == 0:
                write_json(Path(args.out) / f"{drill}.json", result)
            if result["outcome"] == "stopped":  # policy stop: every rank leaves here, with the guard's code
                return result["exit_code"]
    except (BatchTooSmall, Refused) as err:  # every rank with such a share finds it at the first step
        _fail(str(err), EXIT_USAGE)
    except sdc.StopFailed as err:  # every rank learns of a failed save at once (a one-line error, not a traceback)
        _fail(str(err), EXIT_OWN if err.own else EXIT_PEER)
    except PeatError as err:
        _fail(str(err), EXIT_PEER)
    except torch.cuda.OutOfMemoryError as err:  # a RuntimeError too: not to be read as a peer's failure
        _fail(f"rank {rank}: out of memory in {task} ({sdc.first_line(err)}): lower sdc.batch_size", EXIT_OOM)
    dist.destroy_process_group()
    return 0


class Refused(PeatError):
    """A config error found once the ranks had joined (the guard's files): exit EXIT_USAGE, not as a peer's failure."""


def _check_prepared(path, data, name: str, spec: dict, config_file) -> None:
    """One line naming ``path`` and each setting of dataset ``name`` (of ``config_file``) it was not prepared
    with. Under srun the file is the user's (the workflow prepares it again when its settings change): one made
    with another image size, split or seed was drilled without a word. A file records its settings (peat.data)."""
    from .data import SETTINGS_ATTR, settings, sizes

    recorded = data.attrs.get(SETTINGS_ATTR)
    if recorded is None:  # what an older peat's file holds does not show its seed, path or part
        raise PeatError(f"{path}: prepared by an older peat (no {SETTINGS_ATTR!r} attribute); prepare it again "
                        f"(rule prepare_dataset): snakemake --cores 1 --force results/data/{name}.h5 "
                        f"--configfile {config_file}")
    config = settings(spec)
    stale = [f"{key} {value!r} (config: {config.get(key)!r})" for key, value in recorded.items()
             if value != config.get(key)]
    counts, expected = (len(data.train.y), len(data.val.y)), None
    if not stale:  # a split's count is comparable only when the examples are alike
        expected = sizes(name, spec)
    if expected is not None and counts != expected:
        # With the settings alike, only the text read can differ (a path's files, this Python's pydoc).
        stale.append(f"{counts[0]} training and {counts[1]} validation examples (config: {expected[0]} and "
                     f"{expected[1]}; the text it was prepared from differs)")
    if stale:
        raise PeatError(f"{path}: not prepared with the settings of dataset {name!r} (datasets.{name}): "
                        f"{'; '.join(stale)}; prepare it again from this config")


def _fail(message: str, code: int) -> None:
    print(f"{ERROR}{message}", file=sys.stderr, flush=True)
    os._exit(code)  # peers may be gone: skip the process-group teardown that would wait


def load_config(path: str | Path) -> dict:
    """Read and validate a workflow config (defaults filled in) and check the sdc section."""
    import yaml

    from .config import check_unique_keys

    path = Path(path)
    if not path.exists():
        raise PeatError(f"{path}: no such config file")
    # Read on every rank (srun): a folder, a binary file or broken YAML was a traceback from each.
    try:
        check_unique_keys(path)  # as the workflow does: YAML keeps the last of two without a word
        return validated(yaml.safe_load(path.read_text()))
    except IsADirectoryError:
        raise PeatError(f"{path}: is a folder; name the config file") from None
    except UnicodeDecodeError as err:
        raise PeatError(f"{path}: not a YAML or JSON config ({not_utf8(err)})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise PeatError(f"{path}: not valid YAML ({getattr(err, 'problem', None) or sdc.first_line(err)}{at})") from None


def validated(config: dict) -> dict:
    """A copy of ``config`` validated as the workflow does (defaults filled in), sdc section checked.
    Validating twice changes nothing, so a config the workflow validated passes as it is."""
    from .config import SCHEMA, validate

    config = validate(copy.deepcopy(config), SCHEMA)
    check_config(config)
    return config


def check_config(config: dict) -> None:
    """Cross-checks the schema cannot express; one line naming the key."""
    cfg = config["sdc"]
    for name in cfg["models"]:
        if name not in config["models"]:
            raise PeatError(f"config key 'sdc.models': unknown model {name!r}; defined: {', '.join(config['models'])}")
        _check_batch(config, name)
    problem = cfg["drain_marker"] is not None and sdc.marker_problem(cfg["drain_marker"])
    if problem:  # else found by the guard once every rank had started
        raise PeatError(f"config key 'sdc.drain_marker': {cfg['drain_marker']!r}: {problem}")
    if cfg["injected_rank"] >= cfg["world_size"]:
        raise PeatError(f"config key 'sdc.injected_rank': {cfg['injected_rank']} is not below "
                        f"sdc.world_size ({cfg['world_size']})")
    if cfg["injection_step"] >= cfg["steps"]:
        raise PeatError(f"config key 'sdc.injection_step': {cfg['injection_step']} is not below sdc.steps ({cfg['steps']})")
    for drill, spec in cfg["faults"].items():
        try:
            model = errors.parse(spec)
        except PeatError as err:
            raise PeatError(f"config key 'sdc.faults.{drill}': {err}") from None
        if model.mode == "splitk":  # Fault applies it to a tensor alone: the injected rank failed at the injection step
            raise PeatError(f"config key 'sdc.faults.{drill}': {spec!r}: split-K needs a kernel's operands, which a "
                            "drill's fault does not have; use tile:T, tile:T:stale or tile:T:zero")


def _check_batch(config: dict, model: str) -> None:
    """The Trainer's bounds on the global batch, checked from the config: the Trainer refused the
    batch only after torchrun had started every rank."""
    from .data import sizes

    cfg, spec = config["sdc"], config["models"][model]
    batch = cfg["batch_size"] or spec["batch_size"]
    n_train = sizes(spec["dataset"], config["datasets"][spec["dataset"]])[0]
    if not cfg["world_size"] <= batch <= n_train:
        given = batch if cfg["batch_size"] else f"null, so models.{model}.batch_size ({batch}),"
        raise PeatError(f"config key 'sdc.batch_size': {given} is not between sdc.world_size ({cfg['world_size']}) "
                        f"and the {n_train} training examples of dataset {spec['dataset']!r} (model {model!r})")


# --- one drill ----------------------------------------------------------------------------------

class Trainer:
    """A DDP model, its optimizer and the deterministic global batches of the drill."""

    def __init__(self, spec: dict, data, seed: int, device: torch.device, global_batch: int):
        from .models import build
        from .train import epoch_batches, make_optimizer

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.kind, self.device = data.kind, device
        self.x, self.y = data.train.x, data.train.y
        if global_batch < self.world or global_batch > len(self.x):
            raise PeatError(f"config key 'sdc.batch_size': {global_batch} must be between the world size "
                            f"({self.world}) and the training set size ({len(self.x)})")
        self.model = build(spec, data.attrs, seed).to(device).train()
        try:  # DDP checks and broadcasts the model: a peer dead by then was every other rank's traceback, exit 1
            self.ddp = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        except torch.cuda.OutOfMemoryError:
            raise  # this rank's own failure (a RuntimeError too), not a peer's
        except (RuntimeError, dist.DistError) as err:
            raise PeatError(sdc.collective_failure(self.rank, "DDP's broadcast of the model", err)) from None
        self.optimizer = make_optimizer(self.model, spec["optimizer"])
        self._batches = lambda epoch: epoch_batches(len(self.x), global_batch, seed, epoch)
        self._per_epoch = len(self._batches(0))

    def indices(self, step: int):
        """The global batch of ``step``: the same on every rank, so any rank can rebuild a peer's share."""
        return self._batches(1 + step // self._per_epoch)[step % self._per_epoch]

    def loss(self, module: nn.Module, step: int, rank: int) -> torch.Tensor:
        from .train import train_forward

        idx = sdc.shard(self.indices(step), rank, self.world)
        x, y = self.x[idx].to(self.device), self.y[idx].to(self.device)
        return train_forward(module, self.kind, x, y, "sdc.batch_size")[0]  # a rank's share is its batch


def run_drill(drill: str, model_name: str, spec: dict, data, cfg: dict, seed: int, device: torch.device,
              out_dir: Path) -> dict:
    """Train ``cfg['steps']`` guarded DDP steps with ``drill``'s fault on the injected rank."""
    torch.manual_seed(seed)
    trainer = Trainer(spec, data, seed, device, cfg["batch_size"] or spec["batch_size"])
    rank, world = trainer.rank, trainer.world
    events = out_dir / "events" / f"{drill}.jsonl"
    if rank == 0:
        events.parent.mkdir(parents=True, exist_ok=True)
        events.unlink(missing_ok=True)
    try:
        guard = sdc.Guard(trainer.ddp, policy=cfg["policy"], events=events, audit_every=cfg["audit_every"],
                          fingerprint_every=cfg["fingerprint_every"], audit_tolerance=cfg["audit_tolerance"],
                          fused=cfg["fused"],
                          save=lambda path: checkpoint.save(path, trainer.model, trainer.optimizer, step=guard.step,
                                                            epoch=0, meta={"model": model_name, "sdc_drill": drill}),
                          checkpoint=out_dir / f"{drill}.stop.h5", drain_marker=cfg["drain_marker"])
    except sdc.CollectiveFailed:
        raise  # a peer's failure, as at any later collective
    except PeatError as err:  # every rank refuses alike (a drain_marker no rank can write): a config error
        raise Refused(str(err)) from None
    fault = None
    if rank == cfg["injected_rank"]:
        fault = Fault(drill, trainer.model, cfg["injection_step"], cfg["faults"], seed)
    plain, stopped = [], None
    try:
        for step in range(cfg["steps"]):
            plain.append(_drill_step(trainer, guard, fault, step))
        guard.finish()
    except sdc.SDCError:
        pass  # policy raise: every rank raised at the same alarm; the drill ends there
    except SystemExit as stop:  # policy stop: every rank stops at the same alarm, the checkpoint saved
        if stop.code not in (sdc.EXIT_SDC, sdc.EXIT_SDC_UNLOCALIZED):
            raise
        stopped = stop.code
    injected = None if drill == "clean" else cfg["injected_rank"]
    outcome = {"outcome": "completed"} if stopped is None else {"outcome": "stopped", "exit_code": stopped}
    return (summarize(drill, model_name, world, injected, cfg, guard, plain) | outcome
            | origin(dist.get_backend(), guard.hosts, seed))


def origin(backend: str, hosts: list[str], seed: int) -> dict:
    """Where a drill's record came from (docs/reliability.md), whether rank 0 or the launcher writes it."""
    return {"backend": backend, "hosts": hosts, "seed": seed, "torch_version": str(torch.__version__),
            "provenance": stamp(vendor="nvidia" if backend == "nccl" else "cpu")}


def _drill_step(trainer: Trainer, guard: sdc.Guard, fault: "Fault | None", step: int) -> float:
    """One guarded DDP step; returns its time outside the checks (the plain DDP step)."""
    if fault is not None:
        fault.before(step)
    spent = guard.spent
    t0 = time.perf_counter()
    guard.begin_step(step)
    trainer.optimizer.zero_grad(set_to_none=True)
    _backward(trainer, step)
    if guard.check_gradients(replay=lambda r: trainer.loss(guard.module, step, r)):
        trainer.optimizer.step()
    if fault is not None:
        fault.after_step(step)
    guard.check_weights()
    return time.perf_counter() - t0 - (guard.spent - spent)


def summarize(drill: str, model: str, world: int, injected: int | None, cfg: dict, guard: sdc.Guard,
              plain_steps: list[float]) -> dict:
    """The drill's verdict: first alarm at or after the injection, its latency, false alarms, costs."""
    step0 = cfg["injection_step"] if injected is not None else None
    alarms = [{k: v for k, v in e.__dict__.items() if k != "time"} for e in guard.alarms]
    false = [a for a in alarms if _false_alarm(a, injected, step0)]
    hits = [a for a in alarms if injected is not None and a["step"] >= step0]
    first = hits[0] if hits else None
    return drill_fields(drill, model, world, injected, cfg) | {
        "detected": first is not None, "check": first and first["check"],
        "detection_step": first and first["step"],
        "latency_steps": first and first["step"] - step0,
        "suspect_ranks": first["suspect_ranks"] if first else [],
        "localized": first and first["localized"],
        "right_rank": bool(first) and first["suspect_ranks"] == [injected],
        "false_alarms": len(false), "alarms": alarms, "cost": costs(guard, plain_steps, cfg["audit_every"]),
    }


def _false_alarm(alarm: dict, injected: int | None, step0: int | None) -> bool:
    """No fault to find, too early, or not the faulty rank: an unlocalized alarm names every rank it
    cannot tell apart (both of two replicas), the faulty one among them, and is a detection, not a false alarm."""
    if injected is None or alarm["step"] < step0 or injected not in alarm["suspect_ranks"]:
        return True
    return alarm["localized"] and set(alarm["suspect_ranks"]) != {injected}


def drill_fields(drill: str, model: str, world: int, injected: int | None, cfg: dict) -> dict:
    """What a drill was: the same leading fields in every drill's JSON."""
    return {"drill": drill, "model": model, "world_size": world, "injected_rank": injected,
            "injection_step": None if injected is None else cfg["injection_step"], "steps": cfg["steps"],
            "audit_every": cfg["audit_every"], "fingerprint_every": cfg["fingerprint_every"], "policy": cfg["policy"],
            "fused": cfg["fused"]}


def costs(guard: sdc.Guard, plain_steps: list[float], audit_every: int) -> dict:
    """Median time of each check relative to the median plain DDP step, both from this run (None
    without a finished step: policy raise at step 0)."""
    plain = statistics.median(plain_steps) if plain_steps else None
    per_step = guard.costs()
    rel = {c: (t / plain if t is not None and plain is not None else None) for c, t in per_step.items()}
    return {"plain_step_s": plain, **{f"{c}_s": t for c, t in per_step.items()}, "relative": rel,
            "audit_amortized": rel["audit"] / audit_every if rel["audit"] is not None and audit_every else None,
            "nonfinite_plus_fingerprint": (rel["nonfinite"] or 0) + (rel["fingerprint"] or 0)}


# --- faults -------------------------------------------------------------------------------------

class Fault:
    """One drill's fault on the injected rank, from the project's error models (``peat.errors``):
    on a gradient (hook), on matmul outputs (forward hooks) or on the weights after a step.
    """

    def __init__(self, drill: str, model: nn.Module, step: int, specs: dict, seed: int):
        if drill not in DRILLS + RELIABILITY:
            raise PeatError(f"config key 'sdc.drills': unknown drill {drill!r}; allowed: {', '.join(DRILLS + RELIABILITY)}")
        self.drill, self.step, self.seed = drill, step, seed
        self.error = errors.parse(specs[drill]) if drill in specs else None
        self.armed = self.on = False  # armed: this step only; on: from this step on
        matmuls = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) or type(m).__name__ == "Conv1D"]
        params = [p for p in model.parameters() if p.requires_grad]
        if drill == "nan_grad":
            params[-1].register_hook(self._on_gradient)
        elif drill == "lane_fault":
            for m in matmuls:  # persistent: also corrupts this rank's replays of its peer
                m.register_forward_hook(self._persistent)
        elif drill == "transient":
            matmuls[-1].register_forward_hook(self._once)
        self._first = params[0]

    def before(self, step: int) -> None:
        self.armed = step == self.step
        self.on = self.on or self.armed
        if self.armed and self.drill == "dead":
            os._exit(EXIT_DEAD)
        if self.armed and self.drill == "hang":
            time.sleep(10**6)

    def after_step(self, step: int) -> None:
        if self.drill == "weight_flip" and step == self.step:
            with torch.no_grad():
                self._first.copy_(self._corrupt(self._first))

    def _corrupt(self, t: torch.Tensor) -> torch.Tensor:
        # The same generator state on every call: a persistent fault hits the same lane each time. Seeded as
        # peat.errors seeds every injected error (a seed past 32 bits hashed, not cut to its low 32 bits).
        wrong = self.error.apply(t.detach(), errors.seeded(self.seed))
        # The error model's values bit for bit: t + (wrong - t) rounds, so a weight's exponent flip to 8.8e-20
        # wrote 0.0 (19 bits changed, not one), and a NaN-free gradient's -0.0 became +0.0.
        return _Injected.apply(t, wrong) if t.requires_grad else wrong

    def _on_gradient(self, grad):
        return self._corrupt(grad) if self.armed else grad

    def _persistent(self, module, inputs, output):
        return self._corrupt(output) if self.on else output

    def _once(self, module, inputs, output):
        if not self.armed:
            return output
        self.armed = False  # one faulty call: a rerun of this step is correct
        return self._corrupt(output)


class _Injected(torch.autograd.Function):
    """The wrong values forward, the gradient passed through as if the clean ones had been used."""

    @staticmethod
    def forward(ctx, clean, wrong):
        return wrong.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- benchmark ----------------------------------------------------------------------------------

def benchmark(spec: dict, data, cfg: dict, seed: int, device: torch.device, steps: int | None = None) -> dict:
    """Interleave plain DDP steps (built-in all-reduce) with guarded ones on a twin model, same batches.

    ``ratio`` = median guarded step (non-finite check + weight fingerprint) / median plain step over
    the non-audit steps, in wall time; ``cpu_ratio`` the same in this rank's CPU time (all its
    threads: less sensitive to other jobs on a shared machine); ``nonfinite_s``/``fingerprint_s``: median time inside each
    check; ``audit_relative`` = one audit (replay of a peer's micro-batch) / median plain step.
    """
    steps = steps or cfg["bench_steps"]
    gbs = cfg["batch_size"] or spec["batch_size"]
    plain, guarded = (Trainer(spec, data, seed, device, gbs) for _ in range(2))
    # The drills' tolerance: where replays are not bit-exact, a bit-exact audit raised at the first one
    # (a partial sdc section, as tests/test_benchmarks.py gives, audits bit-exact as before).
    guard = sdc.Guard(guarded.ddp, policy="raise", audit_every=2, audit_tolerance=cfg.get("audit_tolerance", 0.0),
                      fused=cfg["fused"])
    t_plain, t_guarded = [], []
    for step in range(steps):
        run_plain, run_guarded = (lambda: _plain_step(plain, step)), (lambda: _drill_step(guarded, guard, None, step))
        if not step % 2:  # audit steps are timed separately through guard.timers
            run_plain()
            run_guarded()
            continue
        # Both sides are timed in the same steps (so neither median holds the cold first step
        # alone) and alternate which goes first, as the harness of benchmarks/ pairs them.
        if step % 4 == 1:
            t_plain.append(_timed(run_plain, device))
            t_guarded.append(_timed(run_guarded, device))
        else:
            t_guarded.append(_timed(run_guarded, device))
            t_plain.append(_timed(run_plain, device))
    guard.finish()
    (p, p_cpu), (g, g_cpu) = ([statistics.median(t[i] for t in ts) for i in (0, 1)] for ts in (t_plain, t_guarded))
    costs = guard.costs()
    return {"steps": steps, "plain_step_s": p, "guarded_step_s": g, "ratio": g / p,
            "plain_step_cpu_s": p_cpu, "guarded_step_cpu_s": g_cpu, "cpu_ratio": g_cpu / p_cpu,
            "nonfinite_s": costs["nonfinite"], "fingerprint_s": costs["fingerprint"],
            "audit_s": costs["audit"], "audit_relative": costs["audit"] / p, "device": str(device)}


def _timed(fn, device) -> tuple[float, float]:
    """Wall and CPU seconds of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _plain_step(trainer: Trainer, step: int) -> None:
    trainer.optimizer.zero_grad(set_to_none=True)
    _backward(trainer, step)
    trainer.optimizer.step()


def _backward(trainer: Trainer, step: int) -> None:
    """This rank's forward and backward of ``step`` through DDP; a peer's failure in its gradient all-reduce
    is one line (--bench's plain steps left every other rank in torch's traceback, exit 1)."""
    try:
        trainer.loss(trainer.ddp, step, trainer.rank).backward()
    except torch.cuda.OutOfMemoryError:
        raise  # this rank's own failure (a RuntimeError too), not a peer's
    except (RuntimeError, dist.DistError) as err:
        raise PeatError(sdc.collective_failure(trainer.rank, f"DDP gradient all-reduce at step {step}", err)) from None


if __name__ == "__main__":
    code = main()
    # After a clean run, gloo's worker threads can still abort the interpreter's finalization
    # (std::terminate: "terminate called without an active exception", exit -6; pytorch#179291),
    # failing a launch whose drills all completed. Every output is written by now and the group is
    # destroyed: skip the finalization. An exception still ends the rank the usual way, above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
