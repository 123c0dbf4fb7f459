"""The old name of :mod:`qwen4exp_ext.tables.file_format`, kept because README named
``qwen4exp_ext.table_file`` as the table file's module (``read_header``, ``TableFileHeader``)
before the tables moved to ``tables/``. It is the same module object, not a copy; new code
imports :mod:`qwen4exp_ext.tables.file_format`."""

import sys

from qwen4exp_ext.tables import file_format

sys.modules[__name__] = file_format
