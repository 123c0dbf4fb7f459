"""The PLE tables outside the GPU: where their rows live and how they get there.

- :mod:`.host_memory`: tables in host memory (pinned and registered for the GPU's zero-copy
  lookup, or on huge pages for the CPU's) and :func:`~.host_memory.footprint`;
- :mod:`.file_format`: the packed table file (``.q4xt``): its header, checks and writer;
- :mod:`.readers`: reading a table file's rows (``"mmap"`` and ``"direct"``) as a
  :class:`~.readers.FileTable`;
- :mod:`.checkpoint`: a PLE table's tensor names, shards and dtypes in a safetensors checkpoint
  (shared by the packer and ``NGramEmbedding``'s loader);
- :mod:`.pack` and :mod:`.cli`: packing a checkpoint into a table file and verifying it
  (``qwen4exp-table``); :mod:`.pack_model`: every PLE layer of a model directory into a table
  directory (``ple<L>.q4xt``) and verifying it (``pack-model``, ``verify-model``);
- :mod:`.shared`: one copy of a table file per node: mapped shared where it is on tmpfs, or
  staged into ``/dev/shm`` by one process under a lock, host-registered for the GPU's
  zero-copy lookup, or left to the CPU-staged lookups when larger than the memory.

Nothing here imports :mod:`qwen4exp_ext.layers`: the layers use the tables, not the reverse.
This ``__init__`` imports nothing, so importing one module does not load the others.
"""
