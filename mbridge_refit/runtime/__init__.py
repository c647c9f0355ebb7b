"""The export runtime: runs an ``ExportPlan`` on this rank.

``schedule`` (pure: the plan cut into gather ops and buckets, and how each HF tensor is assembled),
``collectives`` (process groups and the gathers), ``buffers`` (the bridge-owned output cache),
``selection`` (lazy row selections) and ``exporter`` (``PlanExporter``: the per-step loop).
"""
