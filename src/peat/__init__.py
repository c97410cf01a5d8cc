"""peat: pseudo-error assessment of GPU kernels inside DNN training.

Modules, one concern each, in the order data flows through them: ``config`` (config validation
and hash), ``data`` (dataset prep), ``models`` (models from config), ``train`` (deterministic
training) and ``checkpoint`` (HDF5 checkpoints), ``profiler`` (training-context recording),
``kernels`` (the kernel interface, routing; ``alt_kernels``: the shipped correct alternatives),
``errors`` (pseudo-error models), ``candidate`` (candidate-kernel training and runtime FI),
``playback`` (Playback FI) with ``propagate`` (later observing points), ``scores`` and
``evidence`` (per-tensor scores and Detector features, their hot loops in ``tensor_stats``),
``analyze`` (the Analyzer), ``detect`` (the Detector), ``report`` (the collated report);
``alter`` and ``alter_study`` (checkpoint bit flips and the alteration study); ``sdc``
(silent-data-corruption checks for DDP) and ``sdc_drill`` (their drills). Shared: ``io``,
``device``, ``provenance``, ``slurm``, ``cli``.
"""

import os as _os

__version__ = "0.1.0"

# Kernel calls and candidate trainings run in forked children (``kernels.run_isolated``). A child
# forked after its parent touched the CUDA driver cannot use CUDA ("CUDA error: initialization
# error"), and torch.cuda.is_available() touches it unless torch asks NVML instead. Set before
# anything asks (a vendor check, or transformers on import), so that on a GPU machine a GPU job's
# children can train on the GPU and a CPU job's children can import libraries that ask.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
