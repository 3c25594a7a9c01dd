"""The SSD (cold) tier: a bounded directory of append-only segment files of crash-safe records.

One idea in five modules, read from the top down:

- ``store``: ``SsdStore``, the asynchronous facade the node store talks to (health, the writer
  and reader threads, compaction, a full disk);
- ``bound``: the byte bound: compaction headroom inside ``ssd_bytes``, lowered by a full disk;
- ``index``: the in-memory index (key -> segment, offset, header; each segment's bytes);
- ``scan``: the start-up scan: which files it trusts, segment ids, resynchronising past damage;
- ``segment``: segment files and the blocking I/O on them;
- ``record``: one record's header, padding and payload choice (pure functions);
- ``rawdisk``: the raw-disk baseline the tier is measured against.

``from tierd.daemon.ssd import SsdStore, SsdEntry, RecordSpan`` is the public surface.
"""

from tierd.daemon.ssd.index import RecordSpan, SsdEntry
from tierd.daemon.ssd.store import SsdStore

__all__ = ["RecordSpan", "SsdEntry", "SsdStore"]
