"""The SSD (cold) tier: a bounded directory of append-only segment files of crash-safe records.
``store`` (``SsdStore``, the facade the node store talks to), ``bound`` (the byte bound),
``index`` (key -> segment, offset, header), ``scan`` (the start-up scan), ``segment`` (files and
their blocking I/O), ``record`` (one record's format), ``statefile``, and ``rawdisk`` (the
raw-disk baseline the tier is measured against).
"""

from tierd.daemon.ssd.index import RecordSpan, SsdEntry
from tierd.daemon.ssd.store import SsdStore

__all__ = ["RecordSpan", "SsdEntry", "SsdStore"]
