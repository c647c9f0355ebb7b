"""The LoRA adapter refit, engine-agnostic: an engine's adapter slot fed the trainer's factors,
the base weights left alone.

``adapter`` (what an adapter refit carries and what an engine takes: ``AdapterLimits``,
``check_adapter``) and ``ipc`` (the factors shared with a colocated engine over
``engines.ipc.sharing``: ``AdapterShare`` on the trainer side, ``AdapterReceiver`` on the engine's).
"""
