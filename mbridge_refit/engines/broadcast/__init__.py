"""The refit over a broadcast to engine ranks on other GPUs: the trainer packs the export into
fixed-size buckets and broadcasts them over a group the engine's workers join; each worker walks
the same plan and replays its recorded loader bucket by bucket. Never imports ``engines.ipc``
(``tests/test_package.py``).

``trainer`` (the trainer side: ``BroadcastSession`` packs and sends, calling the workers' join and
receive in the background), ``engine`` (the engine side behind the worker RPCs:
``BroadcastTarget``), ``packed`` (``PackedBroadcastSender``, ``PackedBroadcastReceiver``) over
``wire`` (config, stream packing, checksums, handshake, errors), ``buffers`` (the memory each end
keeps across refits: ``SendBuffers``, ``ReceiveBuffers``), ``bounded_kernels`` (the ends' copies
and checksums on a bounded number of GPU programs) and ``timing`` (per-bucket phase marks for
benchmarks); ``group`` (``StoreGroup``: the process group the trainer and the workers form through
a ``TCPStore``) with ``store_entries`` (its store's entries signed with the group's secret).
"""
