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

__version__ = "0.1.0"
