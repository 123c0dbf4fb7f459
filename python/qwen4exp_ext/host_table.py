"""The old name of :mod:`qwen4exp_ext.tables.host_memory`, kept because README documented
``qwen4exp_ext.host_table.device_view`` / ``pinned_host_table`` / ``empty_host_table`` /
``footprint`` before the tables moved to ``tables/``. It is the same module object, not a copy
(so one set of registrations and mappings, and a monkeypatch of either name patches both); new
code imports :mod:`qwen4exp_ext.tables.host_memory`."""

import sys

from qwen4exp_ext.tables import host_memory

sys.modules[__name__] = host_memory
