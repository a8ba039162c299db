"""The signature-keyed runner: one breakable graph per call signature, with its static input
buffers (``entry.py``), the per-pool turn that orders replays (``pool.py``) and the lifting of
Python scalars into device slots (``scalars.py``); what it reports (``stats.py``) and the calls
``capture_many`` takes (``calls.py``).

Uses ``_capture`` and ``_diagnostics``; nothing below imports it.
"""
