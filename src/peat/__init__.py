"""peat: pseudo-error assessment of GPU kernels inside DNN training.

Modules, one concern each: ``data`` (dataset prep), ``models`` (models from config),
``train`` (deterministic training and HDF5 checkpoints), ``profiler`` (training-context
recording), ``kernels`` and ``errors`` (candidate kernels and pseudo-error models),
``playback``, ``analyze``, ``detect``, ``alter`` (checkpoint bit flips), ``sdc``
(silent-data-corruption checks for DDP) and ``report``.
"""

__version__ = "0.1.0"
